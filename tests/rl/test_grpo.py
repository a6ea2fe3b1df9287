"""GRPO learner: advantages on hand-worked groups, the loss and its gradient against a
hand-written per-episode reference and finite differences, masking, behaviour log-probs equal to
a teacher-forced forward, micro-batch accumulation, mixed precision, a few steps reduce the loss,
config validation, batches that reproduce the engine's token stream."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_models import tiny_model, tiny_tokenizer

from jaxes.models import qwen2
from jaxes.rl import objective
from jaxes.rl.batch import (EpisodeTokens, build_batch, episode_from_messages, episode_from_stream,
                            episode_from_turns)
from jaxes.rl.config import GRPOConfig
from jaxes.rl.grpo import GRPOLearner
from jaxes.rollout import chat, sampling
from jaxes.rollout.engine import Engine
from jaxes.rollout.episodes import EpisodeStream
import helpers_repo

V = 64
SEQ = 24


@pytest.fixture(scope="module")
def model():
  return tiny_model("tiny-gqa", vocab_size=V)


def random_episodes(seed, n=4, lengths=(20, 17, 24, 11)):
  """Episodes of random ids with two sampled spans each (a turn, an observation, a turn)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    m = lengths[i % len(lengths)]
    ids = rng.integers(0, V, m).astype(np.int32)
    sampled = np.zeros(m, bool)
    sampled[3:7] = True
    sampled[m - 4:m] = True
    out.append(EpisodeTokens(ids, sampled, np.zeros(m, np.float32)))
  return out


@functools.partial(jax.jit, static_argnums=(0,))
def _forced(graphdef, params, tokens, length, temperature):
  """Teacher-forced log-probs of one episode [SEQ] (the first ``length`` ids are real)."""
  logits, _ = qwen2.forward(graphdef, params, tokens[None], jnp.arange(SEQ)[None],
                            (jnp.arange(SEQ) < length)[None])
  lp = jax.nn.log_softmax(logits[0, :-1] / temperature, axis=-1)
  return jnp.concatenate([jnp.zeros(1), jnp.take_along_axis(lp, tokens[1:, None], -1)[:, 0]])


def padded(ep):
  return jnp.zeros(SEQ, jnp.int32).at[:len(ep.ids)].set(ep.ids)


def logprobs_of(graphdef, params, episodes, temperature=1.0):
  return [np.asarray(_forced(graphdef, params, padded(ep), len(ep.ids), temperature))[:len(ep.ids)]
          for ep in episodes]


def with_behaviour(episodes, logps, shifts):
  return [dataclasses.replace(ep, behaviour_logp=np.where(ep.sampled, np.asarray(lp) + s, 0.0)
                              .astype(np.float32))
          for ep, lp, s in zip(episodes, logps, shifts)]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _episode_terms(graphdef, cfg: GRPOConfig, params, ref_params, tokens, length, targets,
                   behaviour, adv):
  """Sum over one episode's ``targets`` (indices of its sampled tokens, -1 = none) of GRPO's
  per-token loss, written from its definition."""
  t = jnp.maximum(targets, 0)
  ratio = jnp.exp(_forced(graphdef, params, tokens, length, cfg.temperature)[t] - behaviour[t])
  terms = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * adv)
  if cfg.kl_coef:
    d = (_forced(graphdef, ref_params, tokens, length, cfg.temperature)[t]
         - _forced(graphdef, params, tokens, length, cfg.temperature)[t])
    terms = terms + cfg.kl_coef * (jnp.exp(d) - d - 1)
  return jnp.sum(jnp.where(targets >= 0, terms, 0.0))


def reference_loss_and_grads(graphdef, params, ref_params, episodes, rewards, groups, cfg: GRPOConfig):
  """GRPO's loss and gradient assembled episode by episode: advantages from each group's mean
  and std, then each episode's token sum weighted by the aggregation's normaliser."""
  adv = []
  for r, g in zip(rewards, groups):
    members = [rr for rr, gg in zip(rewards, groups) if gg == g]
    mean = sum(members) / len(members)
    std = (sum((x - mean) ** 2 for x in members) / len(members)) ** 0.5
    adv.append(r - mean if cfg.advantage == "centered" else (r - mean) / (std + cfg.advantage_eps))
  counts = [int(ep.sampled.sum()) for ep in episodes]
  grad_fn = jax.value_and_grad(_episode_terms, argnums=2)
  loss, grads = 0.0, jax.tree.map(jnp.zeros_like, params)
  for i, ep in enumerate(episodes):
    targets = np.full(SEQ, -1, np.int32)
    targets[:counts[i]] = np.flatnonzero(ep.sampled)
    behaviour = jnp.zeros(SEQ).at[:len(ep.ids)].set(ep.behaviour_logp)
    value, g = grad_fn(graphdef, cfg, params, ref_params, padded(ep), len(ep.ids), targets,
                       behaviour, jnp.float32(adv[i]))
    weight = 1 / sum(counts) if cfg.aggregation == "token" else 1 / (counts[i] * len(episodes))
    loss = loss + weight * value
    grads = jax.tree.map(lambda a, b: a + weight * b, grads, g)
  return loss, grads


def perturbed(params, seed, scale):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def tree_close(a, b, rtol, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# -- advantages --------------------------------------------------------------------------------
def test_group_advantages_on_hand_worked_groups():
  rewards = jnp.array([1.0, 0.25, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0, 9.0])
  groups = jnp.array([0, 5, 0, 0, 2, 2, 0, 5, -1])  # groups interleave; row 8 is padding
  z = objective.group_advantages(rewards, groups, "zscore", eps=1e-6)
  # group 0 (1, 0, 1, 0): mean 0.5, std 0.5; group 2: all equal -> 0; group 5 (0.25, 0): mean
  # 0.125, std 0.125.
  np.testing.assert_allclose(z, [1, 1, -1, 1, 0, 0, -1, -1, 0], atol=1e-5)
  c = objective.group_advantages(rewards, groups, "centered")
  np.testing.assert_allclose(c, [0.5, 0.125, -0.5, 0.5, 0, 0, -0.5, -0.125, 0], atol=1e-7)
  lone = objective.group_advantages(jnp.array([3.0, 1.0, 2.0]), jnp.array([0, 1, 1]), "zscore")
  np.testing.assert_allclose(lone, [0.0, -1.0, 1.0], atol=1e-5)  # a group of one has no signal
  with pytest.raises(ValueError, match="advantage kind"):
    objective.group_advantages(rewards, groups, "rank")


def test_token_weights_aggregations():
  sampled = jnp.array([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
  tok = objective.token_weights(sampled, "token")
  np.testing.assert_allclose(tok, sampled / 4.0)
  seq = objective.token_weights(sampled, "sequence")
  np.testing.assert_allclose(seq.sum(axis=1), [0.5, 0.5, 0.0], atol=1e-7)
  np.testing.assert_allclose(seq[0, 1:4], 1 / 6, atol=1e-7)


# -- the loss and its gradient -----------------------------------------------------------------
@pytest.mark.parametrize("options", [
  dict(aggregation="token", advantage="zscore", kl_coef=0.0),
  dict(aggregation="sequence", advantage="centered", kl_coef=0.3, temperature=0.7, clip_eps_high=0.28),
])
def test_loss_and_gradient_equal_hand_written_reference(model, options):
  cfg, graphdef, params = model
  config = GRPOConfig(**options)
  episodes = random_episodes(0)
  logps = logprobs_of(graphdef, params, episodes, config.temperature)
  # Some episodes near the current policy (ratio inside the clip range), some far (clipped).
  episodes = with_behaviour(episodes, logps, [-0.6, 0.5, 0.05, -0.02])
  rewards, groups = [1.0, 0.0, 0.3, 0.9], ["a", "a", "b", "b"]
  ref_params = perturbed(params, 7, 0.02)
  batch = build_batch(episodes, rewards, groups, seq_len=SEQ)
  learner = GRPOLearner(graphdef, config)
  loss, grads, sums = learner.loss_and_grads(params, ref_params if config.kl_coef else None, batch)
  expected, expected_grads = reference_loss_and_grads(graphdef, params, ref_params, episodes,
                                                      rewards, groups, config)
  np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)
  tree_close(grads, expected_grads, rtol=2e-4, atol=1e-6)
  assert 0 < float(sums["clip_fraction"]) < 1  # both branches of the min are exercised
  assert (float(sums["kl"]) > 0) == bool(config.kl_coef)


def test_gradient_equals_finite_differences(model):
  cfg, graphdef, params = model
  config = GRPOConfig(aggregation="sequence", kl_coef=0.1)
  episodes = random_episodes(1)
  episodes = with_behaviour(episodes, logprobs_of(graphdef, params, episodes), [0.05, -0.03, 0.02, -0.08])
  batch = build_batch(episodes, [1.0, 0.0, 0.0, 0.5], [0, 0, 1, 1], seq_len=SEQ)
  learner = GRPOLearner(graphdef, config)
  ref_params = perturbed(params, 3, 0.05)
  _, grads, _ = learner.loss_and_grads(params, ref_params, batch)
  direction = perturbed(jax.tree.map(jnp.zeros_like, params), 11, 1.0)
  norm = optax_norm(direction)
  direction = jax.tree.map(lambda d: d / norm, direction)
  h = 1e-2
  plus, _, _ = learner.loss_and_grads(jax.tree.map(lambda p, d: p + h * d, params, direction), ref_params, batch)
  minus, _, _ = learner.loss_and_grads(jax.tree.map(lambda p, d: p - h * d, params, direction), ref_params, batch)
  numeric = (plus - minus) / (2 * h)
  analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
  assert abs(float(analytic)) > 1e-3
  np.testing.assert_allclose(numeric, analytic, rtol=2e-2)


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.vdot(x, x) for x in jax.tree.leaves(tree)))


def test_only_sampled_tokens_enter_the_loss(model):
  """Garbage behaviour log-probs on context (observation, prompt, padding) tokens change
  nothing; marking the observation tokens as sampled does."""
  cfg, graphdef, params = model
  learner = GRPOLearner(graphdef, GRPOConfig(kl_coef=0.1))
  episodes = random_episodes(2)
  episodes = with_behaviour(episodes, logprobs_of(graphdef, params, episodes), [0.1, -0.1, 0.2, 0.0])
  rewards, groups = [1.0, 0.0, 0.2, 0.7], [0, 0, 1, 1]
  batch = build_batch(episodes, rewards, groups, seq_len=SEQ)
  loss, grads, _ = learner.loss_and_grads(params, params, batch)
  garbage = dataclasses.replace(batch, behaviour_logp=np.where(batch.sampled, batch.behaviour_logp, np.nan))
  loss2, grads2, _ = learner.loss_and_grads(params, params, garbage)
  assert np.isfinite(float(loss2))
  np.testing.assert_array_equal(loss, loss2)
  tree_close(grads, grads2, rtol=0, atol=0)
  leaked = dataclasses.replace(batch, sampled=batch.valid & (np.arange(SEQ) > 0))
  loss3, _, _ = learner.loss_and_grads(params, params, leaked)
  assert abs(float(loss3) - float(loss)) > 1e-3


# -- behaviour log-probs -----------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8)])
def test_sampled_logprobs_equal_teacher_forced_forward(model, temperature, top_p):
  """Tokens drawn one at a time by sample_with_logprob (the same tokens as sample) carry the
  log-probs a teacher-forced forward over the finished sequence gives them."""
  cfg, graphdef, params = model
  n, length, prompt = 3, 16, 4
  temps, tops = jnp.full((n,), temperature), jnp.full((n,), top_p)

  @jax.jit
  def draw(tokens, i, keys):
    logits, _ = qwen2.forward(graphdef, params, tokens, jnp.broadcast_to(jnp.arange(length), tokens.shape),
                              jnp.arange(length)[None] < i,
                              options=qwen2.Options(logits_at=jnp.full((n,), i - 1)))
    tok, lp = sampling.sample_with_logprob(logits, keys, temps, tops)
    return tok, lp, sampling.sample(logits, keys, temps, tops)

  tokens = np.zeros((n, length), np.int32)
  tokens[:, :prompt] = np.random.default_rng(0).integers(0, V, (n, prompt))
  recorded = np.zeros((n, length), np.float32)
  for i in range(prompt, length):
    keys = sampling.row_keys(jax.random.key(5), jnp.arange(n), jnp.full((n,), i))
    tok, lp, plain = draw(jnp.asarray(tokens), i, keys)
    np.testing.assert_array_equal(tok, plain)
    tokens[:, i], recorded[:, i] = tok, lp
  forced = jax.jit(objective.sequence_logprobs, static_argnums=(0, 4, 5))(
    graphdef, params, jnp.asarray(tokens), jnp.ones((n, length), bool), temperature, top_p)
  np.testing.assert_allclose(forced[:, prompt:], recorded[:, prompt:], atol=2e-5)
  assert (recorded[:, prompt:] < 0).all()
  if top_p == 1.0:  # then it is plain log_softmax(logits / T)
    logits, _ = jax.jit(qwen2.forward, static_argnums=0)(
      graphdef, params, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(length), (n, length)),
      jnp.ones((n, length), bool))
    lsm = jax.nn.log_softmax(logits / temperature, axis=-1)
    want = np.take_along_axis(np.asarray(lsm[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(recorded[:, prompt:], want[:, prompt - 1:], atol=2e-5)


def test_logprob_is_of_the_distribution_actually_sampled():
  logits = jnp.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0, 0.5, 1.2])
  n, temperature, top_p = 40000, 0.8, 0.75
  keys = jax.random.split(jax.random.key(0), n)
  tokens, lp = jax.jit(sampling.sample_with_logprob)(jnp.broadcast_to(logits, (n, 8)), keys,
                                                     jnp.full((n,), temperature), jnp.full((n,), top_p))
  freq = np.bincount(np.asarray(tokens), minlength=8) / n
  probs = np.zeros(8)
  probs[np.asarray(tokens)] = np.exp(np.asarray(lp))
  # Hand-worked nucleus: softmax(logits / 0.8), the most likely tokens until the mass reaches 0.75.
  p = np.exp(np.asarray(logits) / temperature)
  p /= p.sum()
  order = np.argsort(-p)
  keep = order[:np.searchsorted(np.cumsum(p[order]), top_p) + 1]
  want = np.zeros(8)
  want[keep] = p[keep] / p[keep].sum()
  np.testing.assert_allclose(probs, want, atol=1e-6)
  np.testing.assert_allclose(freq, want, atol=0.01)
  greedy_tok, greedy_lp = sampling.sample_with_logprob(logits[None], keys[:1], jnp.zeros(1), jnp.ones(1))
  assert int(greedy_tok[0]) == 0 and float(greedy_lp[0]) == 0.0


# -- the learner -------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_equal_the_full_batch(model, aggregation):
  cfg, graphdef, params = model
  episodes = random_episodes(3, n=8)
  episodes = with_behaviour(episodes, logprobs_of(graphdef, params, episodes), [0.1, -0.4] * 4)
  rewards = [1.0, 0.0, 0.5, 0.5, 0.2, 0.9, 0.0, 1.0]
  batch = build_batch(episodes, rewards, [0, 1, 0, 1, 2, 2, 3, 3], seq_len=SEQ)
  ref_params = perturbed(params, 9, 0.02)
  results = {}
  for k in (1, 4):
    learner = GRPOLearner(graphdef, GRPOConfig(micro_batches=k, kl_coef=0.2, aggregation=aggregation,
                                               learning_rate=1e-3))
    results[k] = learner.loss_and_grads(params, ref_params, batch)
  (loss1, grads1, sums1), (loss4, grads4, sums4) = results[1], results[4]
  np.testing.assert_allclose(loss1, loss4, rtol=1e-5)
  tree_close(grads1, grads4, rtol=1e-4, atol=1e-7)
  for key in sums1:
    np.testing.assert_allclose(sums1[key], sums4[key], rtol=1e-5, atol=1e-7)
  assert float(sums1["clip_fraction"]) > 0 and float(sums1["kl"]) > 0
  if aggregation == "token":  # the whole step once: the learner's own metrics and update
    state, metrics = learner.step(learner.init(params, ref_params), batch)
    np.testing.assert_allclose(metrics["loss"], loss1, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax_norm(grads1), rtol=1e-4)
    assert int(metrics["tokens"]) == int(batch.sampled.sum()) and int(metrics["episodes"]) == 8
    with pytest.raises(ValueError, match="micro_batches=3"):
      GRPOLearner(graphdef, GRPOConfig(micro_batches=3)).loss_and_grads(params, None, batch)


def test_remat_equals_the_plain_learner(model):
  """The learner's default (each layer under jax.checkpoint) gives the plain backward's loss,
  gradients and metric sums up to float rounding."""
  cfg, graphdef, params = model
  episodes = random_episodes(6, n=4)
  episodes = with_behaviour(episodes, logprobs_of(graphdef, params, episodes), [0.1, -0.3] * 2)
  batch = build_batch(episodes, [1.0, 0.0, 0.4, 0.9], [0, 0, 1, 1], seq_len=SEQ)
  assert GRPOConfig().remat
  out = [GRPOLearner(graphdef, GRPOConfig(remat=r, micro_batches=2)).loss_and_grads(params, None, batch)
         for r in (True, False)]
  np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5)
  tree_close(out[0][1], out[1][1], rtol=1e-4, atol=1e-7)
  for key in out[0][2]:
    np.testing.assert_allclose(out[0][2][key], out[1][2][key], rtol=1e-5, atol=1e-7)


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(model):
  cfg, graphdef, params = model
  episodes = random_episodes(4, n=8)
  episodes = with_behaviour(episodes, logprobs_of(graphdef, params, episodes), [0.0] * 8)
  batch = build_batch(episodes, [1.0, 0.0, 0.0, 1.0, 0.3, 0.6, 1.0, 0.0], [0, 0, 0, 0, 1, 1, 1, 1],
                      seq_len=SEQ, num_rows=10)
  learner = GRPOLearner(graphdef, GRPOConfig(learning_rate=3e-3, micro_batches=2))
  state = learner.init(params)
  first = float(learner.loss_and_grads(params, None, batch)[0])
  losses = []
  for _ in range(5):
    state, metrics = learner.step(state, batch)
    losses.append(float(metrics["loss"]))
    assert np.isfinite(float(metrics["grad_norm"])) and int(metrics["episodes"]) == 8
  after = float(learner.loss_and_grads(state.params, None, batch)[0])
  assert losses[0] == pytest.approx(first, abs=1e-6)
  assert after < first - 0.05, (first, losses, after)
  assert int(state.step) == 5


def test_bf16_params_keep_float32_master_and_moments(model):
  cfg, graphdef, params = model
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  episodes = random_episodes(5)
  batch = build_batch(episodes, [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], seq_len=SEQ)
  learner = GRPOLearner(graphdef, GRPOConfig(learning_rate=1e-3))
  state = learner.init(bf16)
  state, metrics = learner.step(state, batch)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(state.master)} == {jnp.dtype(jnp.float32)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
  tree_close(state.params, jax.tree.map(lambda m: m.astype(jnp.bfloat16), state.master), rtol=0, atol=0)
  assert np.isfinite(float(metrics["loss"]))
  plain = GRPOLearner(graphdef, GRPOConfig(master_weights=False)).init(bf16)
  assert plain.master is None


def test_config_validation():
  assert GRPOConfig.from_dict(dict(learning_rate=1e-5, aggregation="sequence")).aggregation == "sequence"
  bad = [(dict(learning_rate=0.0), "learning_rate"), (dict(clip_eps_low=1.5), "clip_eps_low"),
         (dict(aggregation="batch"), "aggregation"), (dict(advantage="rank"), "advantage"),
         (dict(micro_batches=0), "micro_batches"), (dict(micro_batches=2.0), "micro_batches"),
         (dict(temperature=0.0), "temperature"), (dict(top_p=1.5), "top_p"),
         (dict(kl_coef=-1.0), "kl_coef"), (dict(master_weights="yes"), "master_weights"),
         (dict(remat=1), "remat"), (dict(logprob_chunk=-1), "logprob_chunk"),
         (dict(logprob_chunk=True), "logprob_chunk"),
         (dict(learning_rate="1e-5"), "learning_rate"), (dict(adam_b2=1.0), "adam_b2")]
  for kwargs, key in bad:
    with pytest.raises(ValueError, match=rf"^GRPOConfig\.{key}: "):
      GRPOConfig(**kwargs)
  with pytest.raises(ValueError, match=r"GRPOConfig\.lr: unknown key"):
    GRPOConfig.from_dict(dict(lr=1e-5))


# -- batches -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_episode_from_turns_lays_out_the_engine_stream(tokenizer):
  tok = tokenizer
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"},
              {"role": "assistant", "content": "a"}, {"role": "user", "content": "out 1"},
              {"role": "assistant", "content": "b"}, {"role": "user", "content": "out 2"},
              {"role": "assistant", "content": "c"}, {"role": "user", "content": "never fed"}]
  turns = [[40, 41, im_end], [50, 51, 52], [60]]  # turn 2 hit the token budget
  logps = [[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3], [-4.0]]
  ep = episode_from_turns(tok, messages, turns, logps)
  prompt = chat.prompt_ids(tok, messages[:2])
  obs1, obs2 = chat.observation_ids(tok, "out 1"), chat.observation_ids(tok, "out 2")
  want = prompt + turns[0] + obs1 + turns[1] + [im_end] + obs2 + turns[2]
  assert ep.ids.tolist() == want
  assert ep.ids[ep.sampled].tolist() == [40, 41, im_end, 50, 51, 52, 60]
  np.testing.assert_allclose(ep.behaviour_logp[ep.sampled], sum(logps, []))
  assert not ep.behaviour_logp[~ep.sampled].any()
  with pytest.raises(ValueError, match="3 assistant messages, 2 sampled turns"):
    episode_from_turns(tok, messages, turns[:2], logps[:2])
  with pytest.raises(ValueError, match="turn 1: 3 sampled ids but 2 log-probs"):
    episode_from_turns(tok, messages, turns, [logps[0], [0.0, 0.0], logps[2]])
  # A transcript re-encoded from text agrees where the text round-trips.
  text = episode_from_messages(tok, messages[:4], behaviour_logp=[0.0] * (len(tok.encode("a")) + 1))
  assert text.ids[text.sampled].tolist() == tok.encode("a") + [im_end]
  with pytest.raises(ValueError, match="assistant tokens"):
    episode_from_messages(tok, messages[:4], behaviour_logp=[0.0])


def test_engine_greedy_turns_match_the_teacher_forced_batch(tokenizer):
  """Episodes decoded by the real engine and rebuilt by episode_from_turns: at every sampled
  position the teacher-forced argmax is the token the engine decoded, so the batch's tokens,
  positions and masks line up with what the engine fed."""
  tok = tokenizer
  cfg, graphdef, params = tiny_model("tiny-gqa", vocab_size=512, seed=1)
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  engine = Engine(graphdef, cfg, num_slots=2, max_len=256, prefill_chunk=16, max_new_tokens=5,
                  stop_ids=[], im_end_id=im_end)
  episodes = []
  for slot in range(2):
    messages = [{"role": "system", "content": "You are in a terminal."},
                {"role": "user", "content": f"task {slot}: count the files"}]
    assert engine.scheduler.start(slot, chat.prompt_ids(tok, messages), version=0, member=-1, stream=slot)
    episodes.append((messages, []))
  for turn_index in range(3):
    done = 0
    while done < 2:
      for t in engine.step({0: params}):
        messages, turns = episodes[t.slot]
        turns.append(t.tokens)
        messages.append({"role": "assistant", "content": tok.decode(t.tokens, skip_special_tokens=True)})
        messages.append({"role": "user", "content": f"(exit_code=0) turn {turn_index}"})
        if turn_index < 2:
          assert engine.scheduler.continue_turn(t.slot, chat.observation_ids(tok, messages[-1]["content"]))
        done += 1
  built = [episode_from_turns(tok, m, turns, [[0.0] * len(x) for x in turns]) for m, turns in episodes]
  batch = build_batch(built, [1.0, 0.0], [0, 0], seq_len=256)
  logits, _ = qwen2.forward(graphdef, params, jnp.asarray(batch.tokens),
                            jnp.broadcast_to(jnp.arange(256), (2, 256)), jnp.asarray(batch.valid))
  predicted = np.asarray(jnp.argmax(logits[:, :-1], axis=-1))
  for row in range(2):
    targets = np.flatnonzero(batch.sampled[row])
    assert len(targets) == sum(len(x) for x in episodes[row][1])
    np.testing.assert_array_equal(predicted[row, targets - 1], batch.tokens[row, targets])


@pytest.mark.parametrize("temperature,top_p", [(0.8, 1.0), (1.2, 0.9)])
def test_engine_logprobs_equal_a_teacher_forced_forward(tokenizer, temperature, top_p):
  """The behaviour log-probs the engine records while sampling multi-turn episodes (Turn.logprobs)
  equal a teacher-forced forward over the stream the runner records (episode_from_stream), at
  float32, under the same nucleus distribution."""
  tok = tokenizer
  cfg, graphdef, params = tiny_model("tiny-gqa", vocab_size=512, seed=2)
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  engine = Engine(graphdef, cfg, num_slots=3, max_len=256, prefill_chunk=16, max_new_tokens=6,
                  stop_ids=[], im_end_id=im_end)
  prompts = [chat.prompt_ids(tok, [{"role": "system", "content": "You are in a terminal."},
                                   {"role": "user", "content": f"task {s}: list the files"}])
             for s in range(3)]
  turns, logprobs, observations = ([[] for _ in range(3)] for _ in range(3))
  for s in range(3):
    assert engine.scheduler.start(s, prompts[s], version=0, member=-1, stream=7 + s, temperature=temperature,
                        top_p=top_p)
  # Three turns per slot, each slot at its own pace (slots prefill in turn, not in lockstep).
  while sum(map(len, turns)) < 3 * 3:
    for t in engine.step({0: params}):
      turns[t.slot].append(tuple(t.tokens))
      logprobs[t.slot].append(tuple(t.logprobs))
      turn_index = len(turns[t.slot]) - 1
      if turn_index < 2:
        obs = chat.observation_ids(tok, f"(exit_code={turn_index}) out {t.slot}")
        assert engine.scheduler.continue_turn(t.slot, obs)
        observations[t.slot].append(tuple(obs))
  streams = [EpisodeStream(tuple(prompts[s]), tuple(turns[s]), tuple(logprobs[s]),
                           tuple(observations[s])) for s in range(3)]
  batch = build_batch([episode_from_stream(x, im_end) for x in streams], [0.0] * 3, [0] * 3, seq_len=256)
  forced = np.asarray(objective.sequence_logprobs(graphdef, params, jnp.asarray(batch.tokens),
                                                  jnp.asarray(batch.valid), temperature, top_p))
  assert batch.sampled.sum() == 3 * 3 * 6 and np.all(batch.behaviour_logp[batch.sampled] < 0)
  np.testing.assert_allclose(forced[batch.sampled], batch.behaviour_logp[batch.sampled], atol=2e-5)


def test_build_batch_rejects_bad_input():
  episodes = random_episodes(6, n=2)
  with pytest.raises(ValueError, match="more than seq_len=8"):
    build_batch(episodes, [0.0, 1.0], [0, 0], seq_len=8)
  with pytest.raises(ValueError, match="2 episodes, 1 rewards"):
    build_batch(episodes, [0.0], [0, 0], seq_len=SEQ)
  with pytest.raises(ValueError, match="finite"):
    build_batch(episodes, [0.0, float("nan")], [0, 0], seq_len=SEQ)
  with pytest.raises(ValueError, match="num_rows=1"):
    build_batch(episodes, [0.0, 1.0], [0, 0], seq_len=SEQ, num_rows=1)
  batch = build_batch(episodes, [0.0, 1.0], ["t7", "t7"], seq_len=SEQ, num_rows=4)
  assert batch.group_ids.tolist() == [0, 0, -1, -1] and not batch.valid[2:].any()


def test_demo_grpo_run_config():
  from jaxes.rl import config as run_config
  from jaxes.train.config import load_config_file
  c = load_config_file(helpers_repo.REPO / "configs" / "demo_grpo.py")
  learner = run_config.from_run_config(c)
  assert learner.temperature == c.rollout.temperature == 1.0 and learner.micro_batches == 4
  assert c.grpo.group_size * c.grpo.tasks_per_update == 32 and c.controller.max_staleness == 0
  assert set(run_config.default_config()) == set(c.grpo)
  for key, value, match in [("group_size", 1, r"config\.grpo\.group_size: must be an int >= 2"),
                            ("seq_len", 4096, r"config\.grpo\.seq_len: must be <= config\.rollout\.max_len"),
                            ("micro_batches", 3, r"config\.grpo\.micro_batches: must divide"),
                            ("aggregation", "mean", r"config\.grpo\.aggregation: must be one of"),
                            ("temperature", 1.0, r"config\.grpo\.temperature: set config\.rollout\.temperature")]:
    bad = c.copy_and_resolve_references()
    with bad.unlocked():
      bad.grpo[key] = value
    with pytest.raises(ValueError, match=match):
      run_config.from_run_config(bad)
  greedy = c.copy_and_resolve_references()
  greedy.rollout.temperature = 0.0
  with pytest.raises(ValueError, match=r"config\.rollout\.temperature: must be > 0"):
    run_config.from_run_config(greedy)

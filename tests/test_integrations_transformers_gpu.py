"""flash_ext inside Hugging Face transformers on the GPU (skipped without a CUDA GPU, the
compiled extension or transformers).

A small Llama-architecture model is built from a config (random init, nothing downloaded):
hidden 256, 4 layers, 8 query / 2 key-value heads (head dim 32), bf16 on cuda. The same weights
run with flash_ext (the name register() returns) and with transformers' SDPA.

Pass criterion (the one DESIGN.md uses for the kernels, applied to the whole model): the
"truth" is the same model with its bf16 weights in float32 and SDPA in float32. flash_ext's
error against the truth may be at most twice bf16 SDPA's error against the truth, plus a small
epsilon -- for the logits (max abs error), the loss, and the gradient of every parameter
(relative error ||g - g_truth|| / ||g_truth||). Both bf16 runs round the same linear layers,
norms and softmax; only the attention kernel differs, so a wrong mask, scale, window or gradient
shows as an error far above SDPA's, while bf16 noise does not fail the test.

Greedy generation: the tokens must equal SDPA's, except that after a step where SDPA's own top
two logits are within bf16 noise of each other (a tie that rounding may break either way) the
rest is not compared.

Run: pytest -q -s tests/test_integrations_transformers_gpu.py   (-s prints the step times)
"""

import copy
import time

import pytest
import torch

from conftest import requires_cuda

transformers = pytest.importorskip("transformers", reason="transformers not installed")

from flash_ext.integrations import transformers as fe_hf  # noqa: E402

pytestmark = requires_cuda

DEVICE = "cuda"
DTYPE = torch.bfloat16
VOCAB = 1024
EPS_LOGITS = 1e-3      # absolute, on logits of magnitude ~1
EPS_REL = 2e-3         # relative, on the loss and on each parameter's gradient


def llama_config(**kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    return transformers.LlamaConfig(**cfg)


def build(config, reference_impl="sdpa", model_cls=None):
    """(flash_ext bf16, reference bf16, reference float32 truth): the same weights."""
    model_cls = model_cls or transformers.AutoModelForCausalLM
    name = fe_hf.register()
    torch.manual_seed(0)
    ours = model_cls.from_config(copy.deepcopy(config), attn_implementation=name)
    ours = ours.to(DEVICE, DTYPE).eval()
    theirs = model_cls.from_config(copy.deepcopy(config), attn_implementation=reference_impl)
    theirs = theirs.to(DEVICE, DTYPE).eval()
    theirs.load_state_dict(ours.state_dict())
    truth = model_cls.from_config(copy.deepcopy(config), attn_implementation=reference_impl)
    truth = truth.to(DEVICE, torch.float32).eval()
    truth.load_state_dict(ours.state_dict())  # bf16 weights, exactly, in float32
    assert ours.config._attn_implementation == name
    return ours, theirs, truth


def check_errors(what, ours, theirs, truth, eps):
    """ours' error against truth <= 2 x theirs' + eps (max abs error)."""
    ours, theirs, truth = (t.float() for t in (ours, theirs, truth))
    err_ours = (ours - truth).abs().max().item()
    err_theirs = (theirs - truth).abs().max().item()
    assert err_ours <= 2 * err_theirs + eps, (
        f"{what}: flash_ext max error {err_ours:.3e} vs bf16 SDPA's {err_theirs:.3e}")
    return err_ours, err_theirs


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_grads(ours, theirs, truth):
    worst = 0.0
    named = zip(ours.named_parameters(), theirs.named_parameters(), truth.named_parameters())
    for (n, po), (_, pt), (_, pr) in named:
        if pr.grad is None or pr.grad.norm() == 0:
            continue
        assert po.grad is not None, n
        e_ours, e_theirs = rel_err(po.grad, pr.grad), rel_err(pt.grad, pr.grad)
        assert e_ours <= 2 * e_theirs + EPS_REL, (
            f"grad of {n}: flash_ext relative error {e_ours:.3e} vs bf16 SDPA's {e_theirs:.3e}")
        worst = max(worst, e_ours)
    return worst


def tokens(batch, seqlen, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seqlen), generator=g).to(DEVICE)


def forward_backward(models, ids):
    """Logits and loss of each model on ids (labels = ids), gradients left in .grad."""
    logits, losses = [], []
    for m in models:
        m.zero_grad(set_to_none=True)
        out = m(ids, labels=ids)
        out.loss.backward()
        logits.append(out.logits.detach())
        losses.append(out.loss.item())
    return logits, losses


def run_all(models, **inputs):
    with torch.no_grad():
        return [m(**inputs).logits for m in models]


# ---- forward, loss, gradients ---------------------------------------------------------------

def test_logits_loss_and_gradients_match_sdpa():
    models = build(llama_config())
    ids = tokens(2, 300)
    logits, losses = forward_backward(models, ids)
    check_errors("logits", *logits, EPS_LOGITS)
    lo, lt, lr = losses
    assert abs(lo - lr) <= 2 * abs(lt - lr) + EPS_REL * lr, (lo, lt, lr)
    worst = check_grads(*models)
    print(f"\nloss flash_ext {lo:.5f} sdpa {lt:.5f} fp32 {lr:.5f}; worst grad rel err {worst:.2e}")


def test_fp32_model_under_autocast():
    """float32 weights under torch.autocast(bfloat16): the attention runs in bf16."""
    ours, theirs, truth = build(llama_config())
    ours, theirs = ours.float(), theirs.float()
    ids = tokens(2, 128)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        lo, lt = ours(ids).logits, theirs(ids).logits
    with torch.no_grad():
        lr = truth(ids).logits
    check_errors("logits under autocast", lo, lt, lr, EPS_LOGITS)


def test_left_padded_batch_matches_sdpa():
    models = build(llama_config())
    ids = tokens(3, 200)
    mask = torch.ones_like(ids)
    mask[0, :57] = 0
    mask[2, :3] = 0
    logits = run_all(models, input_ids=ids, attention_mask=mask)
    valid = mask.bool()
    check_errors("left-padded logits", *(x[valid] for x in logits), EPS_LOGITS)


def test_packed_batch_matches_sdpa():
    """DataCollatorWithFlattening's batch: one row, position_ids restarting at every sequence;
    also with its FlashAttention kwargs (cu_seq_lens_q/k, max_length_q/k)."""
    models = build(llama_config())
    lengths = [100, 37, 1, 200, 175]
    ids = tokens(1, sum(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    # transformers builds SDPA's packed-sequence mask only without a cache
    with torch.no_grad():
        lt = models[1](ids, position_ids=pos, use_cache=False).logits
        lr = models[2](ids, position_ids=pos, use_cache=False).logits
        lo = models[0](ids, position_ids=pos).logits
        lo_kw = models[0](ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                          max_length_q=max(lengths), max_length_k=max(lengths)).logits
    check_errors("packed logits (position_ids)", lo, lt, lr, EPS_LOGITS)
    check_errors("packed logits (cu_seq_lens)", lo_kw, lt, lr, EPS_LOGITS)
    # and each sequence alone gives the same as in the pack
    with torch.no_grad():
        alone = models[2](ids[:, 100:137]).logits
    check_errors("packed vs alone", lo[:, 100:137], lt[:, 100:137], alone, EPS_LOGITS)


def test_packed_batch_gradients_match_sdpa():
    models = build(llama_config())
    lengths = [130, 70, 256]
    ids = tokens(1, sum(lengths), seed=3)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(DEVICE)
    labels = ids.clone()
    labels[0, torch.tensor([0, 130, 200])] = -100  # no prediction across a boundary
    for m in models:
        m.zero_grad(set_to_none=True)
        m(ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    check_grads(*models)


def test_mistral_sliding_window_matches_sdpa():
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, sliding_window=64, pad_token_id=0)
    models = build(cfg)
    ids = tokens(2, 300)
    check_errors("mistral logits", *run_all(models, input_ids=ids), EPS_LOGITS)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    valid = mask.bool()
    logits = run_all(models, input_ids=ids, attention_mask=mask)
    check_errors("mistral left-padded logits", *(x[valid] for x in logits), EPS_LOGITS)


def test_gemma2_sliding_window_and_softcap_match_eager():
    """Gemma 2 (sliding / full layers alternating, attn_logit_softcapping): transformers runs it
    with eager attention (its SDPA has no softcap), so eager is the reference here."""
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=64,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=32,
        pad_token_id=0)
    models = build(cfg, reference_impl="eager")
    ids = tokens(2, 257)
    logits, _ = forward_backward(models, ids)
    check_errors("gemma2 logits", *logits, EPS_LOGITS)
    check_grads(*models)


# ---- generation ---------------------------------------------------------------------------

def check_greedy(ours, theirs, prompt, **kw):
    # min_new_tokens: no row stops early, so both runs have every step (scores: the logits
    # after generate's processors, what greedy took the argmax of)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
              output_logits=True, output_scores=True, return_dict_in_generate=True, **kw)
    with torch.no_grad():
        a, b = ours.generate(prompt, **kw), theirs.generate(prompt, **kw)
    n = prompt.shape[1]
    assert a.sequences.shape == b.sequences.shape
    noise = 4 * (a.logits[0].float() - b.logits[0].float()).abs().max().item() + 1e-3
    for row in range(prompt.shape[0]):
        for t in range(len(b.scores)):
            ta, tb = a.sequences[row, n + t], b.sequences[row, n + t]
            if ta == tb:
                continue
            top2 = b.scores[t][row].float().topk(2).values
            assert (top2[0] - top2[1]).item() <= noise, (
                f"row {row} step {t}: flash_ext chose {ta.item()}, SDPA {tb.item()} and SDPA's "
                f"top-2 margin {(top2[0] - top2[1]).item():.3e} is above bf16 noise {noise:.3e}")
            break  # a tie broken differently: the continuations differ from here on
    return a, b


def test_greedy_generation_matches_sdpa():
    ours, theirs, _ = build(llama_config())
    a, b = check_greedy(ours, theirs, tokens(2, 50))
    print(f"\ngenerated (flash_ext): {a.sequences[0, 50:].tolist()}\n"
          f"generated (sdpa):      {b.sequences[0, 50:].tolist()}")


def test_greedy_generation_left_padded_matches_sdpa():
    ours, theirs, _ = build(llama_config())
    ids = tokens(3, 40)
    mask = torch.ones_like(ids)
    mask[0, :11] = 0
    mask[1, :30] = 0
    ids = ids.masked_fill(mask == 0, 0)
    check_greedy(ours, theirs, ids, attention_mask=mask)


def test_greedy_generation_static_cache_matches_sdpa():
    ours, theirs, _ = build(llama_config())
    check_greedy(ours, theirs, tokens(2, 33), cache_implementation="static")


# ---- training -----------------------------------------------------------------------------

def train_steps(model, batches, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def step_time_ms(model, ids, warmup=3, steps=10):
    """One training step (forward, backward, AdamW) in ms: CUDA events over `steps` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    for _ in range(warmup):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def test_training_steps_track_sdpa_and_print_step_time():
    ours, theirs, _ = build(llama_config())
    batches = [tokens(4, 512, seed=s) for s in range(3)] * 3  # 9 steps, each batch 3 times
    lo, lt = train_steps(ours, batches), train_steps(theirs, batches)
    assert lo[-1] < lo[0] and lt[-1] < lt[0], (lo, lt)  # both fit the repeated batches
    for i, (a, b) in enumerate(zip(lo, lt)):
        assert abs(a - b) <= 0.02 * b, f"step {i}: loss flash_ext {a:.4f} vs SDPA {b:.4f}"
    ids = tokens(4, 2048, seed=9)
    t_ours, t_theirs = step_time_ms(ours, ids), step_time_ms(theirs, ids)
    print(f"\ntraining step (Llama 4 x 256, 8q/2kv heads, batch 4 x 2048, bf16): "
          f"flash_ext {t_ours:.2f} ms, sdpa {t_theirs:.2f} ms ({t_theirs / t_ours:.2f}x)")


def test_attention_dropout_trains():
    """attention_dropout > 0 in training: the kernels' dropout runs, the loss differs from the
    no-dropout loss, gradients are finite; eval mode (dropout 0) matches SDPA's eval."""
    cfg = llama_config(attention_dropout=0.2)
    ours, theirs, truth = build(cfg)
    ids = tokens(2, 256)
    ours.train()
    torch.manual_seed(5)
    loss_drop = ours(ids, labels=ids).loss
    loss_drop.backward()
    assert torch.isfinite(loss_drop)
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    ours.eval()
    with torch.no_grad():
        loss_eval = ours(ids, labels=ids).loss
    assert abs(loss_drop.item() - loss_eval.item()) > 1e-4
    check_errors("eval logits", *run_all((ours, theirs, truth), input_ids=ids), EPS_LOGITS)

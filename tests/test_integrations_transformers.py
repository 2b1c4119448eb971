"""flash_ext.integrations.transformers on CPU: the registration and its name rules, and the
attention / mask functions' argument handling inside real transformers models.

The models run in float32 on CPU with flash_ext's entry points (flash_attn_func,
flash_attn_varlen_func) replaced by flash_ext.reference: what is tested is which call the
integration makes, with which sequences, window, scale and softcap, compared with transformers'
own SDPA (or eager) attention on the same weights. The GPU file runs the kernels."""

import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers not installed")

import flash_ext  # noqa: E402
from flash_ext import reference  # noqa: E402
from flash_ext.integrations import hf_attention, sequence_layout  # noqa: E402
from flash_ext.integrations import transformers as fe_hf  # noqa: E402

try:
    from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    HAS_INTERFACES = True
except ImportError:
    HAS_INTERFACES = False
needs_interfaces = pytest.mark.skipif(
    not HAS_INTERFACES, reason="transformers < 4.53 has no AttentionMaskInterface")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- reference stand-ins for the kernels --------------------------------------------------

class Calls(list):
    """The keyword arguments of every flash_ext call the integration made."""


def _check_common(dropout_p, softmax_scale, causal, window_size, softcap, deterministic):
    assert dropout_p == 0.0, "the reference stand-in runs without dropout"
    assert isinstance(causal, bool) and isinstance(deterministic, bool)
    assert len(window_size) == 2 and all(isinstance(w, int) for w in window_size)


@pytest.fixture
def fake_kernels(monkeypatch):
    """flash_attn_func / flash_attn_varlen_func computed by flash_ext.reference (any dtype, CPU),
    the half-dtype cast off (the models run in float32 here), and unpad_input / pad_input with
    FlashAttention-2's bert_padding behaviour when this checkout's flash_ext has none."""
    calls = Calls()

    def dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        _check_common(dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
        calls.append(dict(kind="dense", shape=tuple(q.shape), k_shape=tuple(k.shape),
                          softmax_scale=softmax_scale, causal=causal,
                          window_size=tuple(window_size), softcap=softcap))
        out, _ = reference.attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap)
        return out.to(q.dtype)

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, deterministic=False, return_attn_probs=False,
               block_table=None):
        _check_common(dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        assert max_seqlen_q == max(lens_q) and max_seqlen_k == max(lens_k)
        calls.append(dict(kind="varlen", lens_q=lens_q, lens_k=lens_k,
                          softmax_scale=softmax_scale, causal=causal,
                          window_size=tuple(window_size), softcap=softcap))
        out, _ = reference.attention_ref_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap)
        return out.to(q.dtype)

    monkeypatch.setattr(flash_ext, "flash_attn_func", dense)
    monkeypatch.setattr(flash_ext, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(hf_attention, "flash_dtype", lambda query, module: None)
    if not hasattr(flash_ext, "unpad_input"):
        monkeypatch.setattr(flash_ext, "unpad_input", _unpad_input, raising=False)
    if not hasattr(flash_ext, "pad_input"):
        monkeypatch.setattr(flash_ext, "pad_input", _pad_input, raising=False)
    sequence_layout._CACHE.clear()
    yield calls
    sequence_layout._CACHE.clear()


def _unpad_input(hidden_states, attention_mask, unused_mask=None):
    """bert_padding.unpad_input's contract (used only when flash_ext has none yet)."""
    assert unused_mask is None
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten()).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(seqlens.max()), seqlens


def _pad_input(hidden_states, indices, batch, seqlen):
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


# ---- models -------------------------------------------------------------------------------

def _llama_config(**kw):
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(kw)
    return transformers.LlamaConfig(**cfg)


def _pair(config, reference_impl="sdpa", model_cls=None):
    """The same random weights twice: with flash_ext and with transformers' reference_impl."""
    name = fe_hf.register()
    model_cls = model_cls or transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    # Each model gets its own config: from_config records the implementation in the config.
    ours = model_cls.from_config(copy.deepcopy(config), attn_implementation=name).eval()
    theirs = model_cls.from_config(copy.deepcopy(config), attn_implementation=reference_impl)
    theirs.eval()
    assert ours.config._attn_implementation == name
    assert theirs.config._attn_implementation == reference_impl
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _generate(model, ids, **kw):
    return model.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)


def _same_generation(a, b):
    """The same greedy tokens, and the logits of every step close."""
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits)
    for la, lb in zip(a.logits, b.logits):
        _close(la, lb)


def _close(a, b, tol=2e-5):
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


# ---- registration -------------------------------------------------------------------------

def test_import_flash_ext_does_not_import_transformers():
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest; import flash_ext; "
            "import flash_ext.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@needs_interfaces
def test_register_returns_an_accepted_name():
    name = fe_hf.register()
    assert name == fe_hf.DEFAULT_NAME
    assert "flash" not in name
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS[name] is hf_attention.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is hf_attention.padding_mask
    assert fe_hf.register() == name  # again: harmless


@needs_interfaces
def test_register_custom_name():
    assert fe_hf.register("my-fast-attn") == "my-fast-attn"
    model = transformers.AutoModelForCausalLM.from_config(
        _llama_config(), attn_implementation="my-fast-attn")
    assert model.config._attn_implementation == "my-fast-attn"


@pytest.mark.parametrize("name", ["flash_ext", "FlashExt", "my_flash", "flash_attention_2",
                                  "sdpa", "my_sdpa", "flex_attention", "eager", "org/repo",
                                  "org/repo:fn", "paged|fext", "", "1abc", "a b"])
def test_register_refuses_names_transformers_treats_specially(name):
    with pytest.raises(ValueError):
        fe_hf.register(name)


def test_register_refuses_non_strings():
    with pytest.raises(TypeError):
        fe_hf.register(3)


@needs_interfaces
def test_register_refuses_a_name_taken_by_another_function():
    from transformers.modeling_utils import AttentionInterface
    AttentionInterface.register("fext-taken", lambda *a, **k: None)
    try:
        with pytest.raises(ValueError, match="already has another function"):
            fe_hf.register("fext-taken")
    finally:
        AttentionInterface._global_mapping.pop("fext-taken", None)


@needs_interfaces
def test_a_flash_name_really_fails_in_transformers():
    """Why the name rule exists: the same functions under a name containing 'flash' do not
    get through model construction (transformers >= 5) -- if this starts passing, the rule can
    be relaxed for that version."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x special-cases only names starting with flash_attention")
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    AttentionInterface.register("flash_probe", hf_attention.attention_forward)
    AttentionMaskInterface.register("flash_probe", hf_attention.padding_mask)
    try:
        with pytest.raises(Exception):
            transformers.AutoModelForCausalLM.from_config(
                _llama_config(), attn_implementation="flash_probe")
    finally:
        AttentionInterface._global_mapping.pop("flash_probe", None)
        AttentionMaskInterface._global_mapping.pop("flash_probe", None)


def test_register_without_interfaces_says_which_version(monkeypatch):
    import transformers.masking_utils as mu
    monkeypatch.delattr(mu, "AttentionMaskInterface")
    with pytest.raises(ImportError, match="AttentionMaskInterface.*4.53"):
        fe_hf.register()


@needs_interfaces
def test_tiny_llama_constructs_and_switches():
    name = fe_hf.register()
    model = transformers.AutoModelForCausalLM.from_config(_llama_config(),
                                                          attn_implementation=name)
    assert model.config._attn_implementation == name
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
        model.set_attn_implementation(name)
        assert model.config._attn_implementation == name


# ---- the attention function inside models -------------------------------------------------

@needs_interfaces
def test_full_batch_matches_sdpa(fake_kernels):
    ours, theirs = _pair(_llama_config())
    ids = torch.randint(3, 128, (2, 17))
    with torch.no_grad():
        _close(ours(ids).logits, theirs(ids).logits)
    assert {c["kind"] for c in fake_kernels} == {"dense"}
    c = fake_kernels[0]
    assert c["causal"] and c["window_size"] == (-1, -1) and c["softcap"] == 0.0
    assert c["softmax_scale"] == pytest.approx(16 ** -0.5)
    assert c["shape"] == (2, 17, 4, 16) and c["k_shape"] == (2, 17, 2, 16)  # GQA: no repeat


@needs_interfaces
def test_left_padded_batch_matches_sdpa(fake_kernels):
    ours, theirs = _pair(_llama_config())
    ids = torch.randint(3, 128, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = theirs(ids, attention_mask=mask).logits
    valid = mask.bool()
    _close(a[valid], b[valid])
    assert {c["kind"] for c in fake_kernels} == {"varlen"}
    assert fake_kernels[0]["lens_q"] == [7, 12, 11]


@needs_interfaces
def test_all_ones_mask_runs_dense(fake_kernels):
    ours, theirs = _pair(_llama_config())
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        _close(ours(ids, attention_mask=torch.ones(2, 9)).logits, theirs(ids).logits)
    assert {c["kind"] for c in fake_kernels} == {"dense"}


def _packed_batch(lengths, vocab=128):
    ids = torch.randint(3, vocab, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return ids, pos, cu


@needs_interfaces
def test_packed_position_ids_match_separate_sequences(fake_kernels):
    ours, theirs = _pair(_llama_config())
    lengths = [5, 9, 1, 7]
    ids, pos, cu = _packed_batch(lengths)
    with torch.no_grad():
        packed = ours(ids, position_ids=pos).logits[0]
        for i, n in enumerate(lengths):
            alone = theirs(ids[:, cu[i]:cu[i + 1]]).logits[0]
            _close(packed[cu[i]:cu[i + 1]], alone)
        # SDPA's own packed-sequence masks (transformers builds them only without a cache)
        _close(packed, theirs(ids, position_ids=pos, use_cache=False).logits[0])
    assert {c["kind"] for c in fake_kernels} == {"varlen"}
    assert fake_kernels[0]["lens_q"] == lengths


@needs_interfaces
def test_packed_rows_in_a_batch_of_two(fake_kernels):
    ours, theirs = _pair(_llama_config())
    ids = torch.randint(3, 128, (2, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    with torch.no_grad():
        _close(ours(ids, position_ids=pos).logits,
               theirs(ids, position_ids=pos, use_cache=False).logits)
    assert fake_kernels[0]["lens_q"] == [4, 6, 7, 3]


@needs_interfaces
def test_flash_varlen_kwargs_match(fake_kernels):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s batch: cu_seq_lens_q/k and
    max_length_q/k go straight to the varlen call."""
    ours, theirs = _pair(_llama_config())
    lengths = [6, 3, 8]
    ids, pos, cu = _packed_batch(lengths)
    with torch.no_grad():
        a = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 max_length_q=8, max_length_k=8).logits
        b = theirs(ids, position_ids=pos, use_cache=False).logits
    _close(a, b)
    assert fake_kernels[0]["kind"] == "varlen" and fake_kernels[0]["lens_q"] == lengths


@needs_interfaces
def test_data_collator_with_flattening(fake_kernels):
    collator = getattr(transformers, "DataCollatorWithFlattening", None)
    if collator is None:
        pytest.skip("this transformers has no DataCollatorWithFlattening")
    ours, theirs = _pair(_llama_config())
    feats = [{"input_ids": torch.randint(3, 128, (n,)).tolist()} for n in (4, 11, 6)]
    batch = collator()(feats, return_tensors="pt")
    batch.pop("labels", None)
    with torch.no_grad():
        _close(ours(**batch).logits, theirs(**batch, use_cache=False).logits)
    assert fake_kernels[0]["lens_q"] == [4, 11, 6]


@needs_interfaces
def test_gradients_match_sdpa(fake_kernels):
    ours, theirs = _pair(_llama_config())
    ours.train(), theirs.train()
    ids = torch.randint(3, 128, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    la = ours(ids, attention_mask=mask, labels=labels).loss
    lb = theirs(ids, attention_mask=mask, labels=labels).loss
    la.backward(), lb.backward()
    _close(la, lb)
    for (n, pa), (_, pb) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert pa.grad is not None, n
        _close(pa.grad, pb.grad, tol=1e-4)


@needs_interfaces
def test_greedy_generation_matches_sdpa(fake_kernels):
    ours, theirs = _pair(_llama_config())
    ids = torch.randint(3, 128, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        _same_generation(_generate(ours, ids, **kw), _generate(theirs, ids, **kw))
    kinds = [c["kind"] for c in fake_kernels]
    assert "varlen" in kinds
    decode = [c for c in fake_kernels if c["kind"] == "varlen" and c["lens_q"] == [1, 1]]
    assert decode and decode[0]["lens_k"] == [5, 8]  # bottom-right: the new token sees its row


@needs_interfaces
def test_generation_without_padding_matches_sdpa(fake_kernels):
    ours, theirs = _pair(_llama_config())
    ids = torch.randint(3, 128, (2, 6))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        _same_generation(_generate(ours, ids, **kw), _generate(theirs, ids, **kw))
    decode = [c for c in fake_kernels if c["kind"] == "dense" and c["shape"][1] == 1]
    assert decode and decode[0]["causal"] and decode[0]["k_shape"][1] == 7


@needs_interfaces
def test_static_cache_generation_matches_sdpa(fake_kernels):
    """A static cache holds unwritten slots after the tokens: the mask function must keep them
    out (greedy tokens alone hardly notice; the logits of every step do)."""
    ours, theirs = _pair(_llama_config())
    ids = torch.randint(3, 128, (2, 6))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        try:
            b = _generate(theirs, ids, **kw)
        except Exception as e:  # an old transformers without static caches on CPU
            pytest.skip(f"static cache generation unavailable: {e}")
        a = _generate(ours, ids, **kw)
    _same_generation(a, b)


@needs_interfaces
def test_mistral_sliding_window_matches_sdpa(fake_kernels):
    cfg = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, pad_token_id=0)
    ours, theirs = _pair(cfg)
    ids = torch.randint(3, 128, (2, 13))
    with torch.no_grad():
        _close(ours(ids).logits, theirs(ids).logits)
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[1, :4] = 0
        valid = mask.bool()
        _close(ours(ids, attention_mask=mask).logits[valid],
               theirs(ids, attention_mask=mask).logits[valid])
    assert fake_kernels[0]["window_size"] == (4, 0)


@needs_interfaces
def test_gemma2_sliding_window_and_softcap_match_eager(fake_kernels):
    """Gemma 2: alternating sliding / full layers and attn_logit_softcapping (transformers runs
    it with eager attention: SDPA has no softcap)."""
    cfg = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        attn_logit_softcapping=20.0, final_logit_softcapping=None, pad_token_id=0,
        query_pre_attn_scalar=16)
    ours, theirs = _pair(cfg, reference_impl="eager")
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        _close(ours(ids).logits, theirs(ids).logits)
    windows = {c["window_size"] for c in fake_kernels}
    assert windows == {(3, 0), (-1, -1)}
    assert {c["softcap"] for c in fake_kernels} == {20.0}
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        _same_generation(_generate(ours, ids, **kw), _generate(theirs, ids, **kw))


# ---- argument handling, unit by unit ------------------------------------------------------

class _Module(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16, **attrs):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4).to(dtype)
        for k, v in attrs.items():
            setattr(self, k, v)


def _qkv(b=2, hq=4, hkv=2, sq=6, sk=6, d=16, dtype=torch.float32):
    return (torch.randn(b, hq, sq, d, dtype=dtype), torch.randn(b, hkv, sk, d, dtype=dtype),
            torch.randn(b, hkv, sk, d, dtype=dtype))


def test_window_conversion():
    w = hf_attention._window
    assert w(None, True, 100) == (-1, -1)
    assert w(8, True, 8) == (-1, -1)       # no query can see more than 8 keys: no window
    assert w(8, True, 9) == (7, 0)         # itself and 7 before: key > query - 8
    assert w(8, False, 9) == (8, 8)        # bidirectional: |query - key| <= 8


def test_module_attributes_are_the_defaults(fake_kernels):
    q, k, v = _qkv(sk=12, sq=12)
    hf_attention.attention_forward(_Module(is_causal=False, sliding_window=4), q, k, v, None)
    c = fake_kernels[-1]
    assert c["causal"] is False and c["window_size"] == (4, 4)
    hf_attention.attention_forward(_Module(is_causal=False, sliding_window=4), q, k, v, None,
                                   is_causal=True, sliding_window=None, scaling=0.5, softcap=3.0)
    c = fake_kernels[-1]
    assert c["causal"] is True and c["window_size"] == (-1, -1)
    assert c["softmax_scale"] == 0.5 and c["softcap"] == 3.0


def test_output_layout_and_value(fake_kernels):
    q, k, v = _qkv(sq=3, sk=7)
    out, weights = hf_attention.attention_forward(_Module(), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 3, 4, 16)
    ref, _ = reference.attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     softmax_scale=0.3, causal=True)
    _close(out, ref)  # seqlen_q < seqlen_k: causal aligned to the bottom-right corner


def test_narrower_value_heads(fake_kernels):
    q, k, _ = _qkv()
    v = torch.randn(2, 2, 6, 8)
    out, _ = hf_attention.attention_forward(_Module(), q, k, v, None)
    assert out.shape == (2, 6, 4, 8)
    ref, _ = reference.attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     causal=True)
    _close(out, ref)


def test_dropout_and_determinism_are_passed(monkeypatch):
    seen = {}

    def spy(q, k, v, **kw):
        seen.update(kw)
        return torch.zeros(q.shape, dtype=q.dtype)
    monkeypatch.setattr(flash_ext, "flash_attn_func", spy)
    q, k, v = _qkv(dtype=torch.bfloat16)
    hf_attention.attention_forward(_Module(), q, k, v, None, dropout=0.1)
    assert seen["dropout_p"] == 0.1 and seen["deterministic"] is False
    hf_attention.attention_forward(_Module(), q, k, v, None, deterministic=True)
    assert seen["dropout_p"] == 0.0 and seen["deterministic"] is True


def test_bad_masks_raise_before_any_call(fake_kernels):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="2-D"):
        hf_attention.attention_forward(_Module(), q, k, v, torch.zeros(2, 1, 6, 6))
    with pytest.raises(ValueError, match="covers 9 keys"):
        hf_attention.attention_forward(_Module(), q, k, v, torch.ones(2, 9))
    with pytest.raises(NotImplementedError, match="sinks"):
        hf_attention.attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(4))
    assert not fake_kernels


def test_flash_dtype():
    q = torch.randn(1, 2, 3, 8)
    assert hf_attention.flash_dtype(q.bfloat16(), _Module(torch.float32)) is None
    assert hf_attention.flash_dtype(q, _Module(torch.float16)) == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hf_attention.flash_dtype(q, _Module(torch.float32)) == torch.bfloat16
    with pytest.raises(TypeError, match="bfloat16"):
        hf_attention.flash_dtype(q, _Module(torch.float32))


def test_float32_inputs_are_cast(monkeypatch):
    seen = {}

    def spy(q, k, v, **kw):
        seen["dtypes"] = (q.dtype, k.dtype, v.dtype)
        return torch.zeros(q.shape, dtype=q.dtype)
    monkeypatch.setattr(flash_ext, "flash_attn_func", spy)
    out, _ = hf_attention.attention_forward(_Module(torch.bfloat16), *_qkv(), None)
    assert seen["dtypes"] == (torch.bfloat16,) * 3 and out.dtype == torch.bfloat16


def test_layouts_are_computed_once_per_mask(fake_kernels, monkeypatch):
    counted = []
    unpad = flash_ext.unpad_input

    def counting(h, m, *a):
        counted.append(1)
        return unpad(h, m, *a)
    monkeypatch.setattr(flash_ext, "unpad_input", counting)
    q, k, v = _qkv()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    for _ in range(3):  # three layers of one forward
        hf_attention.attention_forward(_Module(), q, k, v, mask)
    assert len(counted) == 1
    mask[1, 0] = False  # changed in place: recomputed
    hf_attention.attention_forward(_Module(), q, k, v, mask)
    assert len(counted) == 2


# ---- the mask function --------------------------------------------------------------------

def test_padding_mask_function():
    pm = hf_attention.padding_mask
    full = torch.ones(2, 8, dtype=torch.long)
    assert pm(batch_size=2, q_length=8, kv_length=8, attention_mask=full) is None
    padded = full.clone()
    padded[0, 0] = 0
    m = pm(batch_size=2, q_length=8, kv_length=8, attention_mask=padded)
    assert m.dtype == torch.bool and torch.equal(m, padded.bool())
    # a sliding cache: only the last kv_length columns
    m = pm(batch_size=2, q_length=1, q_offset=7, kv_length=5, kv_offset=3, attention_mask=padded)
    assert m is None
    padded[1, 5] = 0
    m = pm(batch_size=2, q_length=1, q_offset=7, kv_length=5, kv_offset=3, attention_mask=padded)
    assert torch.equal(m, padded[:, -5:].bool())
    # no mask, dynamic cache: nothing to mask
    assert pm(batch_size=2, q_length=1, q_offset=7, kv_length=8) is None
    assert pm(batch_size=2, q_length=8, kv_length=8) is None
    # static cache of 16 slots, 7 written + 1 new: the first 8 keys
    m = pm(batch_size=2, q_length=1, q_offset=7, kv_length=16)
    assert m.shape == (2, 8) and bool(m.all())
    m = pm(batch_size=2, q_length=1, q_offset=torch.tensor(7), kv_length=16)
    assert m.shape == (2, 16) and m[:, :8].all() and not m[:, 8:].any()
    # transformers 4.5x passes cache_position instead of q_length / q_offset
    assert pm(batch_size=2, cache_position=torch.arange(8), kv_length=8) is None
    m = pm(batch_size=2, cache_position=torch.tensor([7]), kv_length=16)
    assert m.shape == (2, 16) and m[:, :8].all() and not m[:, 8:].any()


def test_packed_layout():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    lay = sequence_layout.packed_layout(pos, 1, 9)
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 9] and lay.max_seqlen == 4
    assert lay.cu_seqlens.dtype == torch.int32
    assert sequence_layout.packed_layout(torch.arange(9)[None], 1, 9) is None
    assert sequence_layout.packed_layout(torch.arange(9)[None], 3, 9) is None  # broadcast rows
    # shared positions of a batch of several rows: one sequence per row, without a host sync
    assert sequence_layout.packed_layout(torch.tensor([[2, 3, 4, 2, 3]]), 2, 5) is None
    lay = sequence_layout.packed_layout(torch.tensor([[2, 3, 4, 2, 3], [0, 1, 0, 1, 2]]), 2, 5)
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 7, 10]

"""The compiled extension's op schemas, registered from Python, for CPU test runs on a checkout
where flash_ext._C is not built.

Importing flash_ext needs the ``flash_ext::*`` ops that ``flash_ext._C`` registers in C++
(csrc/ops_*.cpp). Without a build, tests/conftest.py calls
:func:`install` before any test imports flash_ext: it defines the same schemas under the same
namespace, with no kernel behind them (flash_ext/ops.py adds the fake kernels and the autograd
formula as it does for the real ops), and puts an empty module in ``sys.modules`` as
``flash_ext._C``. The CPU tests (fake and meta tensors, torch.compile tracing, the wiring of the
Python layer) then run against these schemas; whatever needs the kernels is skipped
(conftest's ``requires_ext`` and ``requires_cuda``). With a build, none of this is used.

Keep the schemas equal to the C++ ones: test_ops.py and test_autograd.py check the important
parts of the real schemas when the extension is built.
"""

from __future__ import annotations

import sys
import types

import torch

BUILD_INFO = "stand-in: flash_ext._C is not built (tests/stand_in_ops.py)"

SCHEMAS = (
    ("fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
     "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_left, "
     "int window_right, float softcap, float dropout_p=0.0, Tensor? rng_state=None, "
     "bool deterministic=False) -> (Tensor out, Tensor lse)", ()),
    ("fwd_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor? cu_seqlens_q, "
     "Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
     "bool causal, int window_left, int window_right, float softcap, float dropout_p=0.0, "
     "Tensor? rng_state=None) -> Tensor", ()),
    ("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
     "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
     "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
     "bool deterministic, float dropout_p=0.0, Tensor? rng_state=None) "
     "-> (Tensor dq, Tensor dk, Tensor dv)", ()),
    ("dropout_rng_state(Tensor q) -> Tensor", (torch.Tag.nondeterministic_seeded,)),
    ("dropout_mask(Tensor q, Tensor rng_state, int batch, int heads, int seqlen_q, "
     "int seqlen_k, float dropout_p) -> Tensor", ()),
    ("build_info() -> str", ()),
)

_lib = None


def install() -> None:
    """Define the schemas under ``flash_ext`` and stand an empty module in for flash_ext._C."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("flash_ext", "DEF")
    for schema, tags in SCHEMAS:
        _lib.define(schema, tags=tags)
    _lib.impl("build_info", lambda: BUILD_INFO, "CompositeExplicitAutograd")
    stub = types.ModuleType("flash_ext._C", "Stand-in for the compiled extension "
                            "(tests/stand_in_ops.py): the op schemas only, no kernels.")
    sys.modules["flash_ext._C"] = stub

"""KVM (key-value means) attention at the post-projection boundary (docs/kvm.md).

Every query attends, in ONE softmax, to two regions:

* the **window**: the exact keys/values of the current (possibly partial) chunk and of the
  ``window_chunks - 1`` chunks before it (a chunk is ``chunk_size`` tokens, block-aligned);
* the **state**: compressed rows that summarise every older token. Row i holds a sum of prepared
  keys ``s_k``, a sum of values ``s_v`` and a value radius ``rho`` (a token count in the
  ``value_norm="count"`` ablation). Rows are read "just in time": keys as ``LN_s(s_k)``, values as
  ``rho * s_v / max(||s_v||, eps)``.

The first chunk is copied into rows as it arrives (prepared keys, values, ``rho = ||v||``) and
becomes visible once it leaves the window. Each later chunk is *folded* into the state when it
leaves the window, at the first token of a new chunk: a budget says how many of its tokens become
new rows, the least represented tokens (lowest max-similarity to the rows) get them, and every
other token is added, weighted by its merge gate, to the row its key is most similar to (hard
routing; the ``sink_len`` first rows are never targets). See ``fold_chunk`` and
``KVMSettings.append_count``.

Layout: kernel layout (batch, heads, time, dim) for q, k, v and the state. q has Hq heads, k/v and
the merge gate Hkv heads; query head h reads kv head h // (Hq // Hkv). Rows and gates are per kv
head, the two temperatures per query head. Keys arrive after QK-norm and RoPE; RoPE rotates their
first ``rot_dim`` channels, which are zeroed before ``LN_s`` when a key enters the state.

Ties follow the authors' argmax / argsort: routing takes the highest score and, on an exact tie,
the LOWEST row index (``route``); the novelty ranking is ascending and takes the EARLIEST token on
an exact tie (``least_novel``). "Exact" allows ``tie_margin`` (4 ulps of the score itself), the
rounding by which the two implementations can differ, and nothing more. Both score the ungated key
(a positive gate cannot change a choice).

Two implementations of the same computation live here:

* ``kvm_attention`` (no state; differentiable, for training) and ``kvm_step`` (a ``KVMState``;
  any number of tokens per call) share ``process``: a loop over chunk segments whose attention,
  fold and row updates are whole-tensor operations; only routing and selection carry no gradient.
  A ``kvm_step`` call is differentiable in its own inputs but stores detached state, and a call
  that raises leaves the state as it was.
* ``kvm_attention_reference`` / ``kvm_step_reference``: a token-by-token loop with explicit
  per-(batch, head, token) loops written straight from the rules in docs/kvm.md. Slow; kept for the tests and the
  layer's ``reference`` backend.
"""

from slimkv.ops.kvm.core import KVMParams, Rows, fold_chunk, kvm_attention, layer_norm_s, new_rows, prepare_keys, read_values
from slimkv.ops.kvm.reference import kvm_attention_reference, kvm_step_reference
from slimkv.ops.kvm.settings import KVMSettings
from slimkv.ops.kvm.state import KVMState, kvm_step

__all__ = [
    "KVMParams",
    "KVMSettings",
    "KVMState",
    "Rows",
    "fold_chunk",
    "kvm_attention",
    "kvm_attention_reference",
    "kvm_step",
    "kvm_step_reference",
    "layer_norm_s",
    "new_rows",
    "prepare_keys",
    "read_values",
]

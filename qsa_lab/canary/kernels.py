"""Kernels the canary can run, and the adapter protocol for your own.

A kernel is any callable `fn(call: PagedCall) -> Tensor [rows, q_heads, head_dim]`. It gets
one paged-attention call (the query rows, the paged pool in its storage dtype, block table,
seq_lens, positions, selections, scales) and returns the attention output of every row; the
dtype is free (compared bit for bit against the same kernel's control run). It may raise
`KernelSkipped("why")` when it cannot run here; the canary reports that reason.

Built in:
    qsa:<route>          every qsa_lab route by its name in routes.labels (reference, xqa, grouped,
                         grouped+kernel_fix, ...), on the chosen backend (compiled kernels or the
                         emulation); an earlier spelling of a route is refused, naming the
                         route's name now (labels.was_renamed)
    torch:sdpa-math      scaled_dot_product_attention over WHOLE pages of each row's block
    torch:sdpa-efficient table (decoded to fp16 with the scales), unattended slots masked by a
    torch:sdpa-cudnn     boolean mask; the named backend forced with sdpa_kernel. All but math
    torch:sdpa-flash     need a CUDA GPU.
    torch:sdpa-cut       SDPA over each row's keys cut at the attended length (no mask):
                         never reads an unattended slot; needs prefix attention (dense case)
    torch:flex           FlexAttention with a block mask over the same whole pages
                         (eager on the CPU, torch.compile on a GPU)
    torch:flex-paged     torch's experimental paged FlexAttention reading the pool itself

A name is parsed once, where it enters, by qsa_lab.canary.names (which lists the prefixes);
resolve_kernel looks the parsed name up.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable

import torch

from qsa_lab.canary.call import KernelSkipped, PagedCall, plane_index  # noqa: F401 - named here too
from qsa_lab.canary.names import ADAPTER, REGISTERED, KernelName, as_kernel_name, check_registrable
from qsa_lab.routes.labels import ROUTES


# -- qsa_lab routes --------------------------------------------------------------------------------

def qsa_kernel(route: str, backend: str) -> Callable:
    def run(call: PagedCall) -> torch.Tensor:
        from qsa_lab.model.case import validate_case
        from qsa_lab.model.plan import plan_groups
        from qsa_lab.routes.run import run_routes_planned

        # the calls of one canary run differ only in the pool's bytes: the case is checked and
        # planned once (the plan and token lists do not read the pool)
        case = call.to_case()

        def planned():
            validate_case(case)
            return plan_groups(case.to("cuda" if backend == "cuda" else "cpu"))
        plan = call.cached("qsa.plan", planned)
        out = run_routes_planned(case, [route], backend, plan, reference=route == "reference",
                                 memo=call.cached("qsa.tokens", dict)).outputs[route]
        return out.to(call.device)   # routes return CPU tensors; a kernel answers on its call's device
    if route.startswith("grouped"):
        run.paged_inputs = "padded_plan"   # its plan pads every category with the null block
    return run


# -- PyTorch SDPA and FlexAttention over whole pages ----------------------------------------------

SDPA_BACKENDS = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "flash": "FLASH_ATTENTION"}


def _dense_inputs(call: PagedCall):
    """q [rows, Hq, 1, D]; K, V [rows, Hq, S, D] (each KV head repeated for its query heads,
    materialised: some fused backends refuse a zero head stride); mask [rows, 1, 1, S]."""
    k = call.pages("k", heads="q").transpose(1, 2).contiguous()
    v = call.pages("v", heads="q").transpose(1, 2).contiguous()
    return call.q.unsqueeze(2), k, v, call.attend_mask().view(call.rows, 1, 1, -1)


def sdpa_kernel(name: str) -> Callable:
    def run(call: PagedCall) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel as force

        if name != "math" and call.device.type != "cuda":
            raise KernelSkipped(f"SDPA backend {name!r} needs a CUDA GPU")
        q, k, v, mask = _dense_inputs(call)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                with force(getattr(SDPBackend, SDPA_BACKENDS[name])):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                           scale=call.sm_scale)
            except RuntimeError as e:  # the forced backend refuses these inputs (e.g. flash takes no mask):
                # torch says why in warnings; they go into the one skip line, not onto the terminal
                why = [(str(w.message).strip().splitlines() or [""])[0].split(" (Triggered")[0] for w in seen]
                why = [w for w in why if w and "not used because" not in w and "runtime disabled" not in w]
                raise KernelSkipped(f"SDPA backend {name!r} refused the inputs: {_first_line(e)}"
                                    + (f" ({'; '.join(dict.fromkeys(why))})" if why else "")) from e
        for w in seen:      # a call that ran: its warnings as they came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out.squeeze(2)
    return run


def sdpa_cut(call: PagedCall) -> torch.Tensor:
    attend = call.attend()
    n = attend.sum(-1)
    if not torch.equal(attend, torch.arange(attend.shape[1]) < n.unsqueeze(1)):
        raise KernelSkipped("sdpa-cut needs every row to attend a prefix of its pages (a dense case)")
    q, k, v, _ = _dense_inputs(call)
    outs = [torch.nn.functional.scaled_dot_product_attention(q[r:r + 1], k[r:r + 1, :, :int(n[r])],
                                                              v[r:r + 1, :, :int(n[r])], scale=call.sm_scale)
            for r in range(q.shape[0])]
    return torch.cat(outs).squeeze(2)


@functools.lru_cache(maxsize=None)
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # on a GPU the compiled kernel is the one people ship; on the CPU eager is the point
    # (and quick to start), so its "called without torch.compile" warning is silenced
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)

    def eager(*args, **kwargs):
        with warnings.catch_warnings(), flex_untraced():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)
    return eager


@contextlib.contextmanager
def flex_untraced():
    """Eager FlexAttention without dynamo's trace of it: torch's own debugging switch calls the
    same eager operator directly instead of tracing a graph of it first (with the "eager" backend,
    so the same operators either way) on every call. On the CPU the trace costs more than the
    attention itself; the output is the same bits (tests/canary/test_canary_overlap.py). Restored
    on exit; where torch has no such switch, nothing changes."""
    import torch.nn.attention.flex_attention as fa

    before = getattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    if before is None:
        yield
        return
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


def flex(call: PagedCall) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v, mask = _dense_inputs(call)
    attend = mask.view(mask.shape[0], -1)

    def mask_mod(b, h, q_idx, kv_idx):
        return attend[b, kv_idx]

    block_mask = call.cached("flex.block_mask", lambda: create_block_mask(
        mask_mod, B=q.shape[0], H=None, Q_LEN=1, KV_LEN=k.shape[2], device=str(call.device)))
    return _flex_fn(call.device.type)(q, k, v, block_mask=block_mask, scale=call.sm_scale).squeeze(2)


def _paged_block_mask(call: PagedCall):
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    dev, rows, ps = call.device, call.rows, call.page_size
    pages = int(call.kv_cache.shape[0])
    attend = call.attend()                                                  # [rows, max_pages * ps] logical
    paged = PagedAttention(pages, ps, rows, device=dev)
    req = call.token_to_req.cpu().long()
    table = call.block_table.cpu().long()[req]                             # [rows, max_pages]
    used = torch.arange(table.shape[1]) < -(-call.seq_lens.cpu().long()[req] // ps).unsqueeze(1)
    paged.page_table[:, :table.shape[1]] = table.to(dev)                  # padding entries stay 0: the null block
    for r in range(rows):
        paged.physical_to_logical[r, table[r][used[r]].to(dev)] = torch.arange(int(used[r].sum()), device=dev)
    attend_dev = attend.to(dev)
    width = attend.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        # the paged wrapper also evaluates this for dead blocks (logical index < 0) and
        # discards the answer: clamp so that no index leaves the mask
        return attend_dev[b, kv_idx.clamp(0, width - 1)]

    logical = create_block_mask(mask_mod, B=rows, H=None, Q_LEN=1, KV_LEN=attend.shape[1], BLOCK_SIZE=ps,
                                device=str(dev))
    return paged.convert_logical_block_mask(logical)


def flex_paged(call: PagedCall) -> torch.Tensor:
    """torch.nn.attention.experimental PagedAttention: the pool itself is the key sequence;
    a logical block mask (block size = page_size) is mapped to physical pages."""
    dev, rows, hq, ps = call.device, call.rows, call.q_heads, call.page_size
    block_mask = call.cached("flex-paged.block_mask", lambda: _paged_block_mask(call))
    group = hq // call.kv_heads

    def plane(p):  # [rows, Hq, pages * ps, D]: the whole pool, each KV head repeated for its query heads
        vals = call.pool(p).repeat_interleave(group, dim=1)
        if call.mla and p == 1:
            vals = vals[..., :call.v_head_dim]
        return vals.transpose(0, 1).unsqueeze(0).expand(rows, -1, -1, -1).contiguous()

    run = functools.partial(_flex_fn(dev.type), call.q.unsqueeze(2), plane(0), plane(1), block_mask=block_mask,
                            scale=call.sm_scale)
    try:
        return run().squeeze(2)
    except Exception as first:  # noqa: BLE001 - compiled kernels may want a KV tile no larger than a page
        if dev.type != "cuda":
            raise
        try:
            return run(kernel_options={"BLOCK_N": ps}).squeeze(2)
        except Exception as e:  # noqa: BLE001
            raise KernelSkipped(f"paged FlexAttention refused the inputs: {_first_line(first)}; "
                                f"with BLOCK_N={ps}: {_first_line(e)}") from e


TORCH_KERNELS = {"torch:sdpa-math": sdpa_kernel("math"), "torch:sdpa-efficient": sdpa_kernel("efficient"),
                 "torch:sdpa-cudnn": sdpa_kernel("cudnn"), "torch:sdpa-flash": sdpa_kernel("flash"),
                 "torch:sdpa-cut": sdpa_cut, "torch:flex": flex, "torch:flex-paged": flex_paged}


def register_kernel(name: str, fn: Callable) -> None:
    """Make `name` (e.g. 'flashinfer:decode') a built-in kernel, run in this process."""
    check_registrable(name)
    if not callable(fn):
        raise TypeError(f"fn: must be callable fn(PagedCall) -> [rows, q_heads, head_dim], got {type(fn).__name__}")
    REGISTERED[name] = fn


def working_set(kernel, case) -> tuple[int, str] | None:
    """(bytes, what they hold) a built-in kernel allocates on top of the case, estimated before it
    runs; None where qsa_lab cannot say (a user's kernel, a callable, an adapter)."""
    from qsa_lab.model.memory import estimate, gather_bytes

    if not isinstance(kernel, KernelName):
        return None
    if kernel.text == "torch:flex-paged":
        tokens = int(case.kv_cache.shape[0]) * case.page_size
        return (gather_bytes(case.rows, case.q_heads, tokens, case.head_dim),
                "K and V of the whole pool for every row and query head")
    if kernel.text in TORCH_KERNELS:
        tokens = int(case.block_table.shape[1]) * case.page_size
        return (gather_bytes(case.rows, case.q_heads, tokens, case.head_dim),
                "K and V of each row's pages for every query head")
    if kernel.source == "qsa" and case.qsa_unsupported() is None:
        return estimate(case.to_case().geometry).bytes, "the qsa routes' run of this case"
    return None


def registered() -> dict:
    return dict(REGISTERED)


def builtin_kernels() -> tuple:
    return tuple(f"qsa:{r}" for r in ROUTES) + tuple(TORCH_KERNELS) + tuple(REGISTERED)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def kernel_name(kernel) -> str:
    """A kernel's name: the string itself (a KernelName's text), a callable's `canary_name`
    attribute or module:qualname."""
    if isinstance(kernel, (str, KernelName)):
        return str(kernel)
    given = getattr(kernel, "canary_name", None)
    if isinstance(given, str) and given:
        return given
    return f"{getattr(kernel, '__module__', '?')}:{getattr(kernel, '__qualname__', repr(kernel))}"


def resolve_kernel(kernel, qsa_backend: str | None, qsa_reason: str | None = None) -> Callable:
    """A kernel (a KernelName, a name or a callable) -> callable(PagedCall) run in this process;
    ValueError naming the name's option for one qsa_lab does not have. `qsa_backend` None means
    the qsa routes cannot run here (`qsa_reason` says why)."""
    kernel = as_kernel_name(kernel)
    if callable(kernel):
        return kernel
    if kernel.text in REGISTERED:
        return REGISTERED[kernel.text]
    if kernel.source == "qsa":        # the route was checked when the name was parsed
        if qsa_backend is None:
            def unavailable(call):
                raise KernelSkipped(qsa_reason)
            return unavailable
        return qsa_kernel(kernel.function, qsa_backend)
    if kernel.source == "torch":
        if kernel.text not in TORCH_KERNELS:
            raise kernel.error(f"unknown torch kernel {kernel.text!r}; choose from {tuple(TORCH_KERNELS)}")
        return TORCH_KERNELS[kernel.text]
    if kernel.kind == ADAPTER:        # built-in third-party kernels (canary.adapters), not in the default run
        from qsa_lab.canary.adapters import resolve

        return resolve(kernel)
    raise kernel.error(f"{kernel.text!r} names a user's {kernel.kind}: it runs in a worker process "
                       "(canary.execution.Worker), not here")

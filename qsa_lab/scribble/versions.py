"""Which transformers the built-in engine adapter is checked against. Torch-free.

The adapter hooks private internals of transformers' continuous batching
(`ContinuousBatchProcessor._generation_step`, `PagedAttentionCache.cache_tensor`, the allocators'
block tables and trash indexes, `CachePool`, the offloading manager), which changed shape in 5.24
(one cache tensor, sectors, per-type allocators); 5.25 adds an MLA allocator (one row of two
latents per token) and sums `bytes_per_block` over the allocators. The tests run under each
version listed here (`make test`: scripts/test_other_transformers.sh); another version is refused
with one line, never given a verdict. The `scribble` extra of the package spans the same versions.
"""
from __future__ import annotations

from importlib import metadata

SUPPORTED_TRANSFORMERS = ("5.24.0", "5.25.0")


def transformers_version() -> str | None:
    """The installed transformers version, None when it is not installed (no import, no torch)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def refusal(version: str | None = None) -> str | None:
    """None when `version` (default: the installed one) is supported, else the one line to print."""
    version = transformers_version() if version is None else version
    want = " or ".join(SUPPORTED_TRANSFORMERS)
    if version is None:
        return f"transformers: not installed; the scribble needs transformers {want} (pip install 'qsa_lab[scribble]')"
    if version not in SUPPORTED_TRANSFORMERS:
        return (f"transformers: version {version} is not supported; the scribble reads private internals "
                f"of transformers {want} (pip install 'qsa_lab[scribble]')")
    return None


class UnsupportedVersion(RuntimeError):
    """Raised with the one-line refusal as its message."""


def require_supported(version: str | None = None) -> None:
    line = refusal(version)
    if line is not None:
        raise UnsupportedVersion(line)


def machine_facts() -> dict:
    """The report's machine facts (qsa_lab.analysis.leaks.machine_facts: qsa_lab, Python, torch, CUDA,
    GPU, date) plus the engine's: transformers, the machine and processor (imports torch)."""
    import platform

    from qsa_lab.analysis.leaks import machine_facts as report_facts

    return {**report_facts(), "transformers": transformers_version(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine()}

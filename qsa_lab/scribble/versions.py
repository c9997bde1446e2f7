"""The one version gate of the scribble's engine adapters. Torch-free (no engine is imported: the
installed version is read from the package metadata), so the command line decides before it loads
anything; a version an adapter was not written for is refused with one line, never given a verdict.

    TRANSFORMERS.refusal()        # None, or the one line to print
    TRANSFORMERS.require()        # UnsupportedVersion with that line

The transformers adapter hooks private internals of transformers' continuous batching
(`ContinuousBatchProcessor._generation_step`, `PagedAttentionCache.cache_tensor`, the allocators'
block tables and trash indexes, `CachePool`, the offloading manager), which changed shape in 5.24
(one cache tensor, sectors, per-type allocators); 5.25 adds an MLA allocator (one row of two
latents per token) and sums `bytes_per_block` over the allocators. The tests run under each
version listed here (`make test`: scripts/test_other_transformers.sh). The `scribble` extra of the
package spans the same versions. The vLLM adapter's gate: engines/vllm/env.py.
"""
from __future__ import annotations

from qsa_lab.support.machine import package_version


class UnsupportedVersion(RuntimeError):
    """Raised with the one-line refusal as its message."""


class VersionGate:
    """The versions of one package an adapter reads, and the line that refuses any other.

    package: its import name, and how a refusal starts; distributions: the distributions that carry it
    (their version without a local tag: '0.32.0+cpu' -> '0.32.0'); label: how the text names it; who:
    what needs it; reads: what of it the adapter reads; install: how to get a supported one."""

    def __init__(self, package: str, supported: tuple, *, who: str, reads: str, install: str,
                 label: str | None = None, distributions: tuple | None = None):
        self.package, self.supported, self.who, self.reads, self.install = package, supported, who, reads, install
        self.label, self.distributions = label or package, distributions or (package,)

    def installed(self) -> str | None:
        """The installed version (no import, no torch), None when no distribution of it is installed."""
        for dist in self.distributions:
            version = package_version(dist)
            if version is not None:
                return version.split("+")[0]
        return None

    def refusal(self, version: str | None = None) -> str | None:
        """None when `version` (default: the installed one) is supported, else the one line to print."""
        version = self.installed() if version is None else version
        want = f"{self.label} {' or '.join(self.supported)} ({self.install})"
        if version is None:
            return f"{self.package}: not installed; {self.who} needs {want}"
        if version not in self.supported:
            return f"{self.package}: version {version} is not supported; {self.who} reads {self.reads} {want}"
        return None

    def require(self, version: str | None = None) -> None:
        line = self.refusal(version)
        if line is not None:
            raise UnsupportedVersion(line)


TRANSFORMERS = VersionGate("transformers", ("5.24.0", "5.25.0"), who="the scribble",
                           reads="private internals of", install="pip install 'qsa_lab[scribble]'")
SUPPORTED_TRANSFORMERS = TRANSFORMERS.supported
refusal = TRANSFORMERS.refusal        # the public name (qsa_lab.scribble.refusal): transformers' gate

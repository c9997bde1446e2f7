#!/usr/bin/env bash
# Prints `env LD_PRELOAD=<shim>` for `make test` on an AMD CPU, nothing elsewhere.
#
# Why: torch's CPU build links Intel MKL, and MKL chooses its float32 GEMM kernels by CPU vendor.
# On an AMD CPU it takes other kernels than on an Intel one with the same instruction set, and
# their summation order differs in the last bit of a few outputs (seen: 1 ulp in ~0.1 % of the
# emulation's xqa and grouped outputs, on an AVX-512 AMD EPYC). The bit-identity test's recorded
# outputs (tests/data/bitid_*.npz) are MKL's Intel path. A two-function shim that answers MKL's
# vendor check with "Intel" makes it take that path on any x86 CPU; it changes no result's
# meaning, only which (equally valid) summation order MKL uses. Built once into the env.
set -euo pipefail
env_dir=$1
grep -q AuthenticAMD /proc/cpuinfo 2>/dev/null || exit 0
shim=$(cd "$env_dir" && pwd)/qsa_lab-mkl-intel-path.so
if [ ! -f "$shim" ]; then
  cc=$(command -v cc || command -v gcc || true)
  if [ -z "$cc" ]; then
    echo "note: AMD CPU and no C compiler: MKL keeps its AMD path; the bit-identity test may differ in the last bit" >&2
    exit 0
  fi
  printf 'int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_cpuisintel(void) { return 1; }\n' \
    | "$cc" -shared -fPIC -x c -o "$shim" -
fi
echo "env LD_PRELOAD=$shim"

"""The canary's pytest plugin on real FlashInfer kernels, as a kernel library's CI would run it
(needs flashinfer-python and a CUDA GPU; every test skips with the reason otherwise):

    pytest -p qsa_lab.canary.pytest_plugin examples/ci_flashinfer_example.py -q -rf

One test per region x plane x payload of each marker: CUDA-core decode and tensor-core decode
under a window of 8 tokens, head_dim 128, 8 query heads over 2 KV heads, 16-token pages.
"""
import pytest

GEOMETRY = dict(attend="window:8", query_len=1, kv_heads=2, q_heads=8, head_dim=128, page_size=16, requests=3,
                context=40, payloads=["nan", "max"])


@pytest.mark.qsa_canary("flashinfer:decode", **GEOMETRY)
def test_flashinfer_decode(qsa_canary_cell):
    qsa_canary_cell.check()


@pytest.mark.qsa_canary("flashinfer:decode-tc", **GEOMETRY)
def test_flashinfer_decode_tc(qsa_canary_cell):
    qsa_canary_cell.check()

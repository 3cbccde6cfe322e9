"""The capture's top-k log-prob head: the torch path, and the Triton kernel in Triton's CPU interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from eagle3ft.targets import head


def logits_with_ties(t: int, V: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(t, V, generator=g) * 4).to(dtype)
    x[0, 3] = x[0, V - 1] = x.max() + 1  # a tie at the top, in the first and the last block
    x[1, : V // 2] = float("-inf")  # a masked half
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_head_is_the_top_of_a_float64_log_softmax(dtype):
    x = logits_with_ties(6, 1000, dtype)
    ids, lps = head._torch(x, 8)
    full = torch.log_softmax(x.double(), -1)
    assert ids.dtype == torch.int32 and lps.dtype == torch.float32
    assert torch.equal(x.gather(-1, ids.long()), x.topk(8, -1).values)
    torch.testing.assert_close(lps.double(), full.gather(-1, ids.long()), rtol=0, atol=1e-5)


def test_head_chunks_equal_one_pass(monkeypatch):
    lm_head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(50, 16)
    with torch.no_grad():
        whole = head.topk_logprobs(lm_head, hidden, 4)
        monkeypatch.setattr(head, "HEAD_CHUNK_TOKENS", 7)
        chunked = head.topk_logprobs(lm_head, hidden, 4)
    assert torch.equal(whole[0], chunked[0])
    torch.testing.assert_close(whole[1], chunked[1])
    assert not head.use_kernel(lm_head(hidden), 4)  # CPU: the torch path


class TableHead(torch.nn.Module):
    """An lm_head that returns row h[:, 0] of a fixed logits table: any logits, including flat rows."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.table[h[:, 0].long()]


def test_triton_kernels_equal_torch_in_the_interpreter():
    pytest.importorskip("triton")
    # a fresh process: TRITON_INTERPRET is read when the kernels are defined. Blocks of 256 columns (the last
    # partial), groups of 32, 24 candidate slots: row 2 is flat, overflows them and is redone by torch.
    code = textwrap.dedent("""
        import torch
        from eagle3ft.targets import head
        from tests.test_data_head import TableHead, logits_with_ties
        head.BLOCK, head.GROUP, head.CANDIDATES = 256, 32, 24
        for dtype in (torch.bfloat16, torch.float16):
            x = logits_with_ties(5, 1000, dtype)
            x[2] = 1.5
            ids, lps, over = head._fused(x, 8)
            assert over.tolist() == [False, False, True, False, False]
            ref_ids, ref_lps = head._torch(x, 8)
            ok = ~over
            assert ids.dtype == torch.int32 and lps.dtype == torch.float32
            assert torch.equal(x[ok].gather(-1, ids[ok].long()), x[ok].gather(-1, ref_ids[ok].long())), dtype
            torch.testing.assert_close(lps[ok], ref_lps[ok], rtol=0, atol=1e-5)
            assert set(ids[0, :2].tolist()) == {3, 999}
            head.use_kernel = lambda logits, k: True
            ids, lps = head.topk_logprobs(TableHead(x), torch.arange(5.0)[:, None], 8)
            assert torch.equal(x.gather(-1, ids.long()), x.gather(-1, ref_ids.long()))
            torch.testing.assert_close(lps, ref_lps, rtol=0, atol=1e-5)
        print("ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]

"""The reference model end to end on the `mini` preset: prefill vs decode, verify steps,
rollback, batching and tensor parallelism, each against an independent computation."""

import pytest
import torch

from vllm.models.kimi_k3.nvidia.reference.collective import ThreadGroup
from vllm.models.kimi_k3.nvidia.reference.state import StateError

from ._util import mini_model, rel_err, run_steps

# Decode uses the recurrent KDA form and absorbed MLA; prefill uses chunked KDA and
# non-absorbed MLA. They differ only in where bf16 roundings fall, so logits agree to
# about 1% relative (bf16 has 8 significant bits; 93-layer drift is not exercised here).
PREFILL_DECODE_TOL = 3e-2


def _tokens(n, seed=1, vocab=260):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model():
    return mini_model(seed=0)


def test_token_by_token_decode_matches_prefill(model):
    seq = _tokens(40)
    (full,), _ = run_steps(model, [seq], [])
    outs, _ = run_steps(model, [seq[:24]], [[[t]] for t in seq[24:]])
    assert rel_err(outs[0][-1], full[23]) < 1e-6  # the prefill rows themselves
    for j, logits in enumerate(outs[1:]):
        e = rel_err(logits[0], full[24 + j])
        assert e < PREFILL_DECODE_TOL, f"position {24 + j}: rel err {e:.3g}"
    agree = sum(int(l[0].argmax() == full[24 + j].argmax()) for j, l in enumerate(outs[1:]))
    assert agree >= len(outs[1:]) - 1


def test_full_context_decode_matches_prefill(model):
    """Decode runs to the last position of the context (several MLA cache blocks) without
    truncation, matches a prefill of the whole sequence, and one token more is refused."""
    max_len = 150  # > 2 cache blocks of 64
    seq = _tokens(max_len, seed=2)
    (full,), _ = run_steps(model, [seq], [], max_len=max_len)
    outs, state = run_steps(model, [seq[:100]], [[[t]] for t in seq[100:]], max_len=max_len)
    assert state.seq_lens[0] == max_len
    worst = max(rel_err(l[0], full[100 + j]) for j, l in enumerate(outs[1:]))
    assert worst < PREFILL_DECODE_TOL, worst
    with pytest.raises(StateError, match="exceed max_len"):
        state.segment(0, 0, 1, prefill=False)


def test_verify_step_equals_single_steps(model):
    prompts = [_tokens(9, seed=3), _tokens(17, seed=4)]
    drafts = [_tokens(4, seed=5), _tokens(4, seed=6)]
    verify, sv = run_steps(model, prompts, [drafts], max_q=4)
    singles, ss = run_steps(model, prompts, [[[d[t]] for d in drafts] for t in range(4)], max_q=4)
    for t in range(4):
        for r in range(2):
            e = rel_err(verify[1][4 * r + t], singles[1 + t][r])
            assert e < 1e-2, (t, r, e)
    # after the verify step the last token's state sits in slot 3, after single steps in slot 0
    for i, st in sv.kda.items():
        for r in range(2):
            a = st.rec[sv.rec_slot(r, 3)]
            b = ss.kda[i].rec[ss.rec_slot(r, 0)]
            assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_rollback_to_accepted_prefix_is_exact(model, k):
    prompt, drafts, nxt = _tokens(11, seed=7), _tokens(4, seed=8), _tokens(1, seed=9)
    # verify 4 drafts, keep k, then one more token
    got, sg = run_steps(model, [prompt], [[drafts], [nxt]], max_q=4, accept=[[k]])
    # the same tokens fed as a verify step of exactly k drafts
    want, sw = run_steps(model, [prompt], [[drafts[:k]], [nxt]], max_q=4)
    assert sg.seq_lens[0] == sw.seq_lens[0] == len(prompt) + k + 1
    assert torch.equal(got[1][:k], want[1][:k])  # same rows, same math
    assert torch.equal(got[2], want[2]), rel_err(got[2], want[2])
    for i in sg.kda:
        assert torch.equal(sg.kda[i].rec[sg.rec_slot(0, 0)], sw.kda[i].rec[sw.rec_slot(0, 0)])
        assert torch.equal(sg.kda[i].conv[1, :3], sw.kda[i].conv[1, :3])


def test_batch_of_different_lengths_equals_separate_runs(model):
    a, b = _tokens(13, seed=10), _tokens(30, seed=11)
    steps = [[_tokens(1, seed=20 + s), _tokens(1, seed=40 + s)] for s in range(3)]
    both, _ = run_steps(model, [a, b], steps)
    alone_a, _ = run_steps(model, [a], [[s[0]] for s in steps])
    alone_b, _ = run_steps(model, [b], [[s[1]] for s in steps])
    assert rel_err(both[0][:13], alone_a[0]) < 1e-2
    assert rel_err(both[0][13:], alone_b[0]) < 1e-2
    for s in range(1, 4):
        assert rel_err(both[s][0], alone_a[s][0]) < 1e-2
        assert rel_err(both[s][1], alone_b[s][0]) < 1e-2


def test_tp4_shards_sum_to_tp1(model):
    prompt = _tokens(12, seed=12)
    steps = [[_tokens(1, seed=50 + s)] for s in range(3)]
    ref, _ = run_steps(model, [prompt], steps)

    def rank(coll):
        m = mini_model(seed=0, tp=4, rank=coll.rank, coll=coll)
        return run_steps(m, [prompt], steps)[0]

    per_rank = ThreadGroup.run(4, rank)
    for r in range(1, 4):  # every rank ends with the same full-vocab logits
        for a, b in zip(per_rank[0], per_rank[r]):
            assert torch.equal(a, b)
    for a, b in zip(per_rank[0], ref):
        # TP sums partials in a different order than TP1's single GEMM: bf16-level differences
        assert rel_err(a, b) < 2e-2

"""Buckets and padding: dummy rows on the null slot never change a real request."""

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.buckets import bucket_for, buckets_for, pad_to_bucket

from ._util import mini_model, prefill

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]


def test_bucket_choice():
    assert buckets_for(ROWS, 1) == ROWS and buckets_for(ROWS, 8) == [8, 16, 32, 64]
    assert buckets_for(ROWS, 3) == [3, 6]
    assert [bucket_for(r, 1, ROWS) for r in (1, 8, 9, 17, 64, 65)] == [1, 8, 16, 32, 64, None]
    assert bucket_for(3 * 8, 8, ROWS) == 32 and bucket_for(9 * 8, 8, ROWS) is None
    with pytest.raises(ValueError, match="tokens per request must be >= 1"):
        buckets_for(ROWS, 0)


@pytest.mark.parametrize("q, bucket", [(1, 8), (2, 16)])
def test_padded_step_equals_unpadded_step(q, bucket):
    model = mini_model(seed=0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (5, 9, 13)]
    drafts = torch.randint(0, 260, (3 * q,), generator=g)

    def run(padded: bool):
        st = model.new_state(max_requests=3, max_len=64, max_q=q)
        slots = prefill(model, st, prompts)
        segs = [st.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)]
        ids = drafts
        if padded:
            segs = pad_to_bucket(segs, q, bucket, st)
            ids = torch.cat([drafts, torch.randint(0, 260, (bucket - 3 * q,), generator=g)])
        return model.logits(model.forward(ids, segs, st))[:3 * q], st

    want, sw = run(False)
    got, sg = run(True)
    assert torch.equal(got, want)
    assert sg.seq_lens == sw.seq_lens and sg.accepted == sw.accepted
    for i in sw.kda:  # every real slot identical; only the null slot 0 may differ
        assert torch.equal(sg.kda[i].rec[1:], sw.kda[i].rec[1:])
        assert torch.equal(sg.kda[i].conv[1:], sw.kda[i].conv[1:])
    for i in sw.mla:
        assert torch.equal(sg.mla[i].cache[1:], sw.mla[i].cache[1:])


def test_padding_refuses_mixed_steps():
    model = mini_model(seed=0)
    st = model.new_state(max_requests=1, max_len=16, max_q=2)
    r = st.allocate()
    with pytest.raises(ValueError, match="only pure decode steps"):
        pad_to_bucket([st.segment(r, 0, 3, prefill=True)], 2, 8, st)
    with pytest.raises(ValueError, match="cannot be padded"):
        pad_to_bucket([st.segment(r, 0, 2, prefill=False)], 2, 7, st)


def test_padding_refuses_a_decode_request_of_another_token_count():
    """A decode request of 3 tokens in a 2-token step is refused as such, not reported as a row
    count that does not fill the bucket."""
    st = mini_model(seed=0).new_state(max_requests=1, max_len=16, max_q=3)
    r = st.allocate()
    with pytest.raises(ValueError, match="only pure decode steps of 2 tokens"):
        pad_to_bucket([st.segment(r, 0, 3, prefill=False)], 2, 8, st)


@pytest.mark.parametrize("q, requests, bucket", [(1, 1, 2), (1, 3, 8), (2, 3, 16), (4, 1, 8), (4, 3, 16)])
def test_padding_fills_the_bucket_exactly_with_q_token_dummies(q, requests, bucket):
    """The padded step holds exactly `bucket` rows, in order, each dummy q tokens: one dummy short,
    the graph would read rows no segment wrote."""
    st = mini_model(seed=0).new_state(max_requests=3, max_len=16, max_q=q)
    slots = [st.allocate() for _ in range(requests)]
    segs = pad_to_bucket([st.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], q, bucket, st)
    assert sum(s.n for s in segs) == bucket
    assert [s.row0 for s in segs] == list(range(0, bucket, q)) and {s.n for s in segs} == {q}
    assert [s.request for s in segs[requests:]] == [-1] * ((bucket - requests * q) // q)

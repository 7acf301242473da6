"""The LLM-facing API (packing/llm.py): token sequences -> packed rows with per-sequence
position_ids, seq_lengths and cu_seqlens; and packed rows train to the same loss and
gradients as the sequences one by one (a tiny causal transformer, fp32, torch only here)."""
import numpy as np
import pytest

from packing import PackingError, batch_cu_seqlens, pack_dataset, pack_sequences, pack_stream

L = 32


def _sequences(n=60, seed=0, max_length=L, vocab=50):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(length)).tolist() for length in rng.integers(1, max_length + 1, n)]


def _unpack(rows, num_sequences):
    """The input sequences, rebuilt from the packed rows alone."""
    out = [None] * num_sequences
    for index in range(len(rows)):
        row = rows[index]
        members = rows.sequence_indices[rows.seq_row_offsets[index]:rows.seq_row_offsets[index + 1]]
        for member, start, stop in zip(members, row["cu_seqlens"][:-1], row["cu_seqlens"][1:]):
            assert out[member] is None
            out[member] = row["input_ids"][start:stop].tolist()
    return out


@pytest.mark.parametrize("algorithm,depth", [("lpfhp", None), ("lp", 3), ("spfhp", 2), ("greedy", None),
                                             ("ffd", 4), ("none", 1)])
def test_rows_hold_every_sequence_once_with_restarting_positions(algorithm, depth):
    sequences = _sequences()
    rows = pack_sequences(sequences, L, algorithm, depth, seed=1)
    assert _unpack(rows, len(sequences)) == sequences
    for row in rows:
        assert row["input_ids"].size <= L and row["seq_lengths"].size <= (depth or L)
        assert row["cu_seqlens"][0] == 0 and row["cu_seqlens"][-1] == row["input_ids"].size
        expected = np.concatenate([np.arange(n) for n in row["seq_lengths"]])
        assert np.array_equal(row["position_ids"], expected)
    assert len(rows) == rows.result.num_packs
    columns = rows.to_columns()
    assert [len(r) for r in columns["input_ids"]] == [sum(s) for s in columns["seq_lengths"]]
    assert batch_cu_seqlens(list(rows))[-1] == sum(len(s) for s in sequences)


def test_padded_rows_and_extra_columns():
    sequences = _sequences(seed=2)
    labels = [[-token for token in sequence] for sequence in sequences]
    rows = pack_sequences(sequences, L, "lp", None, columns={"labels": labels})
    padded = rows.padded(pad_token_id=0)
    assert padded["input_ids"].shape == padded["labels"].shape == (len(rows), L)
    real = padded["sequence_ids"] > 0
    assert np.array_equal(padded["labels"][real], -padded["input_ids"][real])
    assert np.all(padded["labels"][~real] == -100) and np.all(padded["input_ids"][~real] == 0)
    assert int(real.sum()) == sum(len(s) for s in sequences)


def test_truncate_and_refusals():
    with pytest.raises(PackingError, match=r"^sequence 1 has 40 tokens, more than max_sequence_length 32; "
                                           r"pass truncate=True or drop it$"):
        pack_sequences([[1] * 5, [2] * 40], L)
    rows = pack_sequences([[1] * 5, list(range(40))], L, truncate=True)
    assert sorted(map(len, _unpack(rows, 2))) == [5, 32] and _unpack(rows, 2)[1] == list(range(32))
    with pytest.raises(PackingError, match=r"^sequence 1 is empty; drop empty sequences first$"):
        pack_sequences([[1], []], L)
    with pytest.raises(PackingError, match=r"^column 'labels' does not match input_ids at sequence 0$"):
        pack_sequences([[1, 2]], L, columns={"labels": [[1]]})
    with pytest.raises(PackingError, match=r"must be a flat sequence of integer token ids"):
        pack_sequences([[1.5, 2]], L)
    with pytest.raises(PackingError, match="seed must be a non-negative integer"):
        pack_sequences([[1]], L, seed=-1)
    with pytest.raises(PackingError, match=r"^columns must be a dict of column name -> token sequences, got str$"):
        pack_sequences([[1]], L, columns="labels")
    for bad in (0, 2.5, "x", None, float("nan")):
        with pytest.raises(PackingError, match=r"^chunk_size must be a positive integer, got "):
            list(pack_stream([[1]], L, chunk_size=bad))
    for bad in ("x", None, 1.5):
        with pytest.raises(PackingError, match=r"^pad_token_id must be an integer token id, got "):
            pack_sequences([[1]], L).padded(pad_token_id=bad)
    with pytest.raises(PackingError, match=r"^label_pad_id must be an integer token id, got 1.5$"):
        pack_sequences([[1]], L).padded(label_pad_id=1.5)


def test_stream_packs_chunk_by_chunk():
    sequences = _sequences(n=250, seed=3)
    seen = []
    for row in pack_stream(iter(sequences), L, chunk_size=64, algorithm="lpfhp"):
        for member, start, stop in zip(row["sequence_indices"], row["cu_seqlens"][:-1], row["cu_seqlens"][1:]):
            assert row["input_ids"][start:stop].tolist() == sequences[member]
            seen.append(int(member))
    assert sorted(seen) == list(range(250))


def test_hugging_face_dataset():
    datasets = pytest.importorskip("datasets")
    sequences = _sequences(seed=4)
    dataset = datasets.Dataset.from_dict({"input_ids": sequences, "labels": sequences,
                                          "text": ["x"] * len(sequences)})
    packed = pack_dataset(dataset, L, extra_columns=("labels",), algorithm="lp")
    assert set(packed.column_names) == {"input_ids", "labels", "position_ids", "seq_lengths"}
    assert sum(map(len, packed["input_ids"])) == sum(map(len, sequences))
    assert all(len(ids) <= L for ids in packed["input_ids"])
    with pytest.raises(PackingError, match="the dataset has no column 'tokens'"):
        pack_dataset(dataset, L, column="tokens")


# -- packed rows train like the sequences one by one ---------------------------------------


def _tiny_causal_lm(torch, vocab=50, width=16, max_positions=L):
    torch.manual_seed(0)
    nn = torch.nn

    class TinyCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(max_positions, width)
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)

        def forward(self, input_ids, position_ids, sequence_ids):
            """[B, S] each; a token attends to earlier tokens of its own sequence only."""
            hidden = self.tokens(input_ids) + self.positions(position_ids)
            q, k, v = self.qkv(hidden).chunk(3, dim=-1)
            scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
            S = input_ids.shape[1]
            causal = torch.ones(S, S, dtype=torch.bool).tril()
            same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
            allowed = same & causal
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            hidden = hidden + self.out(scores.softmax(-1) @ v)
            hidden = hidden + self.mlp(self.norm(hidden))
            return self.head(hidden)

    return TinyCausalLM()


def _loss(torch, model, input_ids, position_ids, sequence_ids):
    """Next-token cross-entropy summed over every token whose successor is in the same
    sequence, and the number of such tokens."""
    logits = model(input_ids, position_ids, sequence_ids)
    target = input_ids[:, 1:]
    valid = (sequence_ids[:, 1:] == sequence_ids[:, :-1]) & (sequence_ids[:, 1:] > 0)
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1),
                                               reduction="none")
    return (losses * valid.reshape(-1)).sum(), valid.sum()


@pytest.mark.parametrize("algorithm,depth", [("lp", None), ("lpfhp", 3)])
def test_packed_rows_train_like_unpacked_sequences(algorithm, depth):
    torch = pytest.importorskip("torch")
    sequences = _sequences(n=40, seed=5)
    model = _tiny_causal_lm(torch)

    # Unpacked: every sequence alone in its own row.
    total, count = torch.zeros(()), torch.zeros((), dtype=torch.long)
    for sequence in sequences:
        ids = torch.tensor([sequence])
        loss, n = _loss(torch, model, ids, torch.arange(len(sequence))[None], torch.ones_like(ids))
        total, count = total + loss, count + n
    unpacked = total / count
    unpacked.backward()
    unpacked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    # Packed: the rows of pack_sequences, padded to L, positions and sequence ids from it.
    rows = pack_sequences(sequences, L, algorithm, depth).padded(pad_token_id=0)
    batch = {name: torch.from_numpy(rows[name]) for name in ("input_ids", "position_ids", "sequence_ids")}
    assert batch["input_ids"].shape[0] < len(sequences)  # it did pack
    loss, n = _loss(torch, model, **batch)
    packed = loss / n
    packed.backward()
    assert int(n) == int(count)
    packed, unpacked = float(packed.detach()), float(unpacked.detach())
    assert abs(packed - unpacked) <= 1e-5, (packed, unpacked)
    for parameter, expected in zip(model.parameters(), unpacked_grads):
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-4, atol=1e-5)

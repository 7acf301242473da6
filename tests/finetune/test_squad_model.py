"""The packed QA model: packed == unpacked per feature (logits, losses, gradients, answers),
ours == transformers' BertForQuestionAnswering on the same weights, no span across features."""
import numpy as np
import pytest
import torch

from bert_packed.tasks.squad.data import collate_question_answering, feature_slots, pack_features
from bert_packed.tasks.squad.metrics import feature_logits, postprocess_predictions
from bert_packed.tasks.squad.model import BertForQuestionAnswering, span_loss_terms
from bert_packed.model.modeling import BertConfig
from squad_fixtures import make_features

S, STRIDE, QUERY, K = 192, 64, 24, 4
TOLERANCE = 1e-5  # fp32, absolute


@pytest.fixture(scope="module")
def data():
    return make_features(S, STRIDE, QUERY)[1:]


def _config(vocab_size, **overrides):
    values = dict(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=256, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, max_sequences_per_pack=K, initializer_range=0.3)
    values.update(overrides)
    return BertConfig(**values)


def _run(model, features, depth, micro_batch_size=64):
    """Per-feature logits [F, S] and the mean loss, from packs of ``depth`` features."""
    torch.manual_seed(0)
    assignment = pack_features(features.lengths, max_sequence_length=S, max_sequences_per_pack=depth)
    start = np.zeros((features.num_features, S), np.float32)
    end = np.zeros_like(start)
    loss_sum, rows = 0.0, 0
    slots_all = feature_slots(assignment, depth)
    from bert_packed.collate import slice_assignment

    for first in range(0, assignment.num_packs, micro_batch_size):
        part = slice_assignment(assignment, first, min(first + micro_batch_size, assignment.num_packs))
        batch = collate_question_answering(features.samples(), part, max_sequence_length=S, max_sequences_per_pack=depth)
        batch["normalizer"] = np.full(len(batch["input_ids"]), features.num_features, np.float32)
        out = model(**{k: torch.as_tensor(v) for k, v in batch.items()})
        loss_sum = loss_sum + out["loss"]
        feature_logits(batch, out["start_logits"].detach().numpy(), out["end_logits"].detach().numpy(),
                       slots_all[first:first + len(batch["input_ids"])], start, end)
        rows += len(batch["input_ids"])
    return start, end, loss_sum, rows


def test_packed_equals_unpacked_per_feature_with_identical_answers(data, one_thread):
    examples, tokenizer, features = data
    torch.manual_seed(1)
    model = BertForQuestionAnswering(_config(tokenizer.get_vocab_size())).eval()
    with torch.no_grad():
        s1, e1, loss1, rows1 = _run(model, features, 1)
        sk, ek, lossk, rowsk = _run(model, features, K)
    assert rowsk < 0.8 * rows1  # the packed run really packs
    real = features.input_mask.astype(bool)
    assert np.abs(s1 - sk)[real].max() <= TOLERANCE and np.abs(e1 - ek)[real].max() <= TOLERANCE
    assert abs(float(loss1) - float(lossk)) <= TOLERANCE
    for version_2 in (False, True):
        a = postprocess_predictions(examples, features, s1, e1, version_2_with_negative=version_2)
        b = postprocess_predictions(examples, features, sk, ek, version_2_with_negative=version_2)
        assert a.answers == b.answers and len(a.answers) == len(examples) >= 200
        if version_2:
            assert np.allclose(list(a.null_odds.values()), list(b.null_odds.values()), atol=2 * TOLERANCE)
    # The random model's answers are varied, not one constant string (the comparison means something).
    assert len(set(a.answers.values())) > 20


def test_packed_step_has_the_unpacked_gradient(data, one_thread):
    """Loss per feature, mean over the step's features (global count): the same step packed or padded."""
    _, tokenizer, features = data
    subset = features.select(slice(0, 120))
    grads = []
    for depth in (1, K):
        torch.manual_seed(2)
        model = BertForQuestionAnswering(_config(tokenizer.get_vocab_size())).train()
        _, _, loss, _ = _run(model, subset, depth, micro_batch_size=16)
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=TOLERANCE, rtol=1e-4), name


def test_no_span_crosses_features():
    """A huge logit in feature 2 changes nothing for feature 1: each softmax sees its own tokens."""
    sequence_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
    logits = torch.zeros(1, 8)
    logits[0, 1] = 1.0
    positions = torch.tensor([[1, 4]])
    weights = torch.tensor([[1.0, 1.0]])
    base = span_loss_terms(logits, logits, sequence_ids, positions, positions, weights)
    loud = logits.clone()
    loud[0, 5] = 50.0  # feature 2's token
    loud[0, 7] = 80.0  # padding
    terms = span_loss_terms(loud, loud, sequence_ids, positions, positions, weights)
    assert terms["start_scores"][0, 0].argmax() == 1 and terms["start_scores"][0, 1].argmax() == 5
    # Feature 1's loss (alone on its 3 tokens) is unchanged; the total changes by feature 2's only.
    alone = -torch.log_softmax(torch.tensor([0.0, 1.0, 0.0]), 0)[1]
    assert torch.allclose(base["loss_sum"] - alone, -torch.log_softmax(torch.zeros(4), 0)[1])
    feature2 = -torch.log_softmax(torch.tensor([0.0, 0.0, 50.0, 0.0]), 0)[1]  # target column 4 = its token 1
    assert torch.allclose(terms["loss_sum"], alone + feature2, atol=1e-6)


def test_transformers_question_answering_checkpoint_gives_the_same_logits(data, tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")
    _, tokenizer, features = data
    ours_config = _config(tokenizer.get_vocab_size())
    hf_config = transformers.BertConfig(**ours_config.to_hf_dict())
    torch.manual_seed(3)
    hf = transformers.BertForQuestionAnswering(hf_config).eval()
    hf.save_pretrained(tmp_path)
    # What --init-checkpoint runs: read the directory, load by name, report what was not loaded.
    from bert_packed.io import hf_io

    pretrained = hf_io.read_pretrained(str(tmp_path))
    model = BertForQuestionAnswering(BertConfig.from_hf(pretrained.hf_config, max_sequences_per_pack=K)).eval()
    report = hf_io.load_weights(model, pretrained.state_dict, source=str(tmp_path))
    assert "newly initialised" not in report and "not used" not in report, report
    assert set(model.hf_state_dict()) == set(hf.state_dict()) - {"bert.embeddings.position_ids",
                                                                 "bert.embeddings.token_type_ids"}
    n = 48
    ids = torch.as_tensor(features.input_ids[:n])
    mask = torch.as_tensor(features.input_mask[:n])
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=torch.as_tensor(features.segment_ids[:n]))
        s, e, _, _ = _run(model, features.select(slice(0, n)), K)
    real = mask.bool().numpy()
    assert np.abs(theirs.start_logits.numpy() - s)[real].max() <= TOLERANCE
    assert np.abs(theirs.end_logits.numpy() - e)[real].max() <= TOLERANCE

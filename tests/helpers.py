"""Assertions shared by several test files."""


def assert_one_line_error(result, *needles):
    """A user mistake: exit status 2 and exactly one ``error: ...`` line on stderr that
    names each of ``needles``."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def stop_after(backend, num_steps):
    """Make ``backend`` send this process SIGTERM after its ``num_steps``-th step, as a kill would:
    the loop checkpoints that step and raises Interrupted. Returns ``backend``."""
    import signal

    train_step, calls = backend.train_step, []

    def step_then_stop(micro_batches):
        result = train_step(micro_batches)
        calls.append(1)
        if len(calls) == num_steps:
            signal.raise_signal(signal.SIGTERM)
        return result

    backend.train_step = step_then_stop
    return backend


def count_raw_bit_masks(monkeypatch):
    """Spy on ``bert_packed.model.dropout``'s raw-bit mask draws: returns the list that collects the
    shape of every mask drawn from now on (the draws themselves still happen)."""
    from bert_packed.model import dropout as dropout_module

    shapes = []
    real = dropout_module._keep_mask
    monkeypatch.setattr(dropout_module, "_keep_mask", lambda *args: shapes.append(args[0]) or real(*args))
    return shapes

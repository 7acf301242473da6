"""Assertions shared by several test files."""


def assert_one_line_error(result, *needles):
    """A user mistake: exit status 2 and exactly one ``error: ...`` line on stderr that
    names each of ``needles``."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]

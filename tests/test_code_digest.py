"""The code part of cache keys (:func:`fisherkron.env.code_digest`): what a file computes, not how it is written.

The parse behind it is kept per process for each source text, so these tests edit a file between two digests
in one process: an edit to the code must change the digest at once, an edit to a comment or a docstring never.
"""
from fisherkron.env import code_digest, code_text

SOURCE = '''"""A module."""


def f(x):
    """Add one."""
    return x + 1  # the step
'''


def test_an_edited_file_is_read_again_in_the_same_process(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(SOURCE)
    first = code_digest([p])
    assert code_digest([p]) == first
    p.write_text(SOURCE.replace("Add one.", "Add 1.").replace("# the step", "# one more"))
    assert code_digest([p]) == first  # comments and docstrings are not what the code computes
    p.write_text(SOURCE.replace("x + 1", "x + 2"))
    assert code_digest([p]) != first
    p.write_text(SOURCE)
    assert code_digest([p]) == first


def test_the_kept_answer_equals_a_fresh_parse():
    a = code_text(SOURCE)
    assert code_text(SOURCE) is a  # kept, not parsed again
    assert code_text(SOURCE + "\n") == a and code_text(SOURCE.replace("1", "2")) != a


def test_file_names_and_order_are_part_of_the_digest(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    assert code_digest([a, b]) != code_digest([b, a])
    c = tmp_path / "c.py"
    c.write_text("x = 1\n")
    assert code_digest([a]) != code_digest([c])

"""The one-line errors: how a library's exception is quoted inside one."""

from dflash_train.errors import in_brief


def test_a_library_error_is_quoted_by_its_type_and_first_line_marked_where_cut():
    assert in_brief(ValueError("bad header\n  at byte 8\n")) == "ValueError: bad header"
    assert in_brief(KeyError()) == "KeyError"
    long = in_brief(OSError("x" * 300), limit=20)
    assert long == "OSError: " + "x" * 20 + "..."

"""The one rule for a text the service takes: in POST /predict, the Open
Inference Protocol's infer and the free examples of POST /feedback.

A text is non-empty (not only whitespace), at most `limits.max_text_chars`
characters and valid Unicode (so that it encodes as UTF-8: JSON can carry an
unpaired surrogate escape, which cannot). One status per broken rule,
wherever the text came: 400 `empty_text`, 422 `text_too_long` (a
validation error, not 413: that status is about the body's size), 400
`bad_text` (docs/api.md, **Texts**)."""
from __future__ import annotations


def text_problem(text: str, where: str, max_chars: int) -> tuple[int, str, str] | None:
    """(status, code, message) of what is wrong with `text`, named `where` in
    the message, or None when it is a good text."""
    if not text or text.isspace():
        return 400, "empty_text", f"{where} is empty"
    if len(text) > max_chars:
        return 422, "text_too_long", f"{where} has {len(text)} characters; the limit is {max_chars}"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return 400, "bad_text", (f"{where} contains an unpaired surrogate escape, "
                                     "which is not valid Unicode")
    return None

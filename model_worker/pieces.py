"""Subword pieces for the words a pretrained view's table lacks in every form.

layers.PretrainedLogits `pieces`: the word with the tokenizer's word-start
mark, split greedily from the left into the longest piece of the
tokenizer's vocabulary at each place (a character no piece starts with
adds nothing). The tokenizer's own BPE picks the same pieces for about two
words in three (docs/models.md); no TensorFlow op runs its BPE, so the
graph runs this split (layers.greedy_pieces) as the lean engine
(model_worker/lean.py) and the search's folds (pretrained.word_pieces) run
it here. The standard library only: layers, lean and pretrained import it.
"""
from __future__ import annotations

from bisect import bisect_right

PIECE_MARK = "\u2581"
LONGEST_PIECE = 16  # characters of the tokenizer's longest piece
MOST_PIECED = 32  # characters of the longest word that gets pieces (longer: none)


def greedy_pieces(word: str, pieces: list[str]) -> list[int]:
    """The places in `pieces` (sorted, distinct) of `word`'s pieces: from
    the start of PIECE_MARK + word, the longest piece there, then on after
    it; a place no piece starts at is skipped. [] for a word longer than
    MOST_PIECED characters. The longest piece that starts a string t is
    found by bisection: the last piece e <= t is it when t starts with e;
    otherwise every piece starting t also starts t's common prefix with e
    (it lies between that piece and t), so the search goes on with that
    prefix."""
    if len(word) > MOST_PIECED:
        return []
    text = PIECE_MARK + word
    out: list[int] = []
    at, end = 0, len(text)
    while at < end:
        t = text[at:at + LONGEST_PIECE]
        while t:
            j = bisect_right(pieces, t) - 1
            e = pieces[j] if j >= 0 else ""
            if e and t.startswith(e):
                out.append(j)
                at += len(e)
                break
            m = 0
            for a, b in zip(e, t):
                if a != b:
                    break
                m += 1
            t = t[:m]
        else:
            at += 1
    return out

"""mtp/chunks.py: the chunks of a decoding shown as text, in colour and as a PNG."""
from mtp.chunks import chunk_texts, render_chunks, save_chunks_png, wrap_cells


class CharTokenizer:
    """Token i is the letter chr(97 + i % 26) (enough to render chunks)."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_chunk_rendering(tmp_path):
    texts = chunk_texts(CharTokenizer(), [0, 1, 2, 3, 4, 5], [3, 1, 2])
    assert texts == ["abc", "d", "ef"]
    plain = render_chunks("> ", texts, [3, 1, 2], colour=False)
    assert plain == "> [abc]₃[d]₁[ef]₂"
    coloured = render_chunks("> ", texts, [3, 1, 2], colour=True)
    assert coloured.count("\x1b[0m") == 6 and "abc" in coloured
    path = tmp_path / "chunks.png"
    save_chunks_png(str(path), "> ", texts + ["line\nbreak"], [3, 1, 2, 4], title="test")
    assert path.stat().st_size > 1000


def test_wrapping_keeps_words_whole():
    chars = [(ch, 0) for ch in "ab cd efgh"]
    cells, last_row = wrap_cells(chars, width=5)
    lines = {}
    for row, _, ch, _ in cells:
        lines[row] = lines.get(row, "") + ch
    assert last_row == 1 and lines == {0: "ab cd", 1: "efgh"}

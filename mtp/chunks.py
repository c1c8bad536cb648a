"""Showing the chunks a decoder emitted, one per forward pass (the paper's Figure 1): in a
terminal, each chunk on an alternating background with its size as a subscript; as a PNG, the
same on a monospace grid. A learner can skip this file: it is display, not the method.
"""

import itertools


def chunk_texts(tokenizer, tokens, chunk_sizes) -> list[str]:
    """The text of each chunk, decoded as prefixes: a character split across
    chunks lands whole in the chunk that completes it."""
    texts = []
    done = ""
    for n, end in zip(chunk_sizes, itertools.accumulate(chunk_sizes)):
        full = tokenizer.decode(tokens[:end])
        if full.startswith(done):
            texts.append(full[len(done):])
        else:
            # the longer prefix decodes differently: the chunk's tokens alone
            texts.append(tokenizer.decode(tokens[end - n:end]))
        done = full
    return texts


# blue, orange
BACKGROUNDS = ("\x1b[30;48;5;153m", "\x1b[30;48;5;223m")
PNG_COLOURS = ("#b9d9f5", "#fbd8a8")


def render_chunks(prompt_text, texts, sizes, colour=True) -> str:
    """Prompt, then each chunk on an alternating background followed by its size
    as a dim subscript (the number of tokens that pass emitted). Without colour,
    chunks are bracketed."""
    out = [prompt_text]
    for i, (text, n) in enumerate(zip(texts, sizes)):
        sub = str(n).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))
        if not colour:
            out.append(f"[{text}]{sub}")
            continue
        # each line coloured on its own, so the background stops at line ends
        lines = [f"{BACKGROUNDS[i % 2]}{line}\x1b[0m" if line else ""
                 for line in text.split("\n")]
        body = "\n".join(lines)
        out.append(f"{body}\x1b[2m{sub}\x1b[0m")
    return "".join(out)


def wrap_cells(chars, width):
    """(char, chunk) pairs placed on a monospace grid `width` wide, wrapped at
    spaces -> cells (row, col, char, chunk), and the index of the last row."""
    cells = []
    row = 0
    col = 0
    wrapped = False
    for i, (ch, chunk) in enumerate(chars):
        # a word starting here: wrap before it unless it fits
        word = 0
        if ch not in " \n" and col > 0 and chars[i - 1][0] == " ":
            ends = (j for j in range(i, len(chars)) if chars[j][0] in " \n")
            word = next(ends, len(chars)) - i
        # a longer word than a line is cut
        if ch == "\n" or col >= width or col + word > width:
            row += 1
            col = 0
            wrapped = ch != "\n"
        # a wrapped line skips its leading spaces
        if ch != "\n" and not (ch == " " and col == 0 and wrapped):
            cells.append((row, col, ch, chunk))
            col += 1
    return cells, row


def save_chunks_png(path, prompt_text, texts, sizes, title="", width=80):
    """The same as a PNG: a monospace grid wrapped at spaces, each chunk's size
    above its start."""
    from matplotlib import figure, patches

    # chunk -1 is the prompt
    chars = [(ch, chunk) for chunk, text in [(-1, prompt_text)] + list(enumerate(texts))
             for ch in text.replace("\t", "    ")]
    cells, last_row = wrap_cells(chars, width)

    n_cols = max((c for _, c, _, _ in cells), default=0) + 1
    line_h = 1.6
    size = (n_cols * 0.11 + 0.4, (last_row + 1) * 0.26 + 0.6)
    ax = figure.Figure(figsize=size).subplots()
    for i, (r, c, ch, chunk) in enumerate(cells):
        y = -r * line_h
        if chunk >= 0:
            ax.add_patch(patches.Rectangle((c, y - 0.55), 1, 1.3,
                                           color=PNG_COLOURS[chunk % 2], lw=0))
        ax.text(c + 0.5, y, ch, ha="center", va="center", family="monospace", fontsize=9,
                parse_math=False, color="#666666" if chunk < 0 else "black")
        # a chunk's first character carries its size
        if chunk >= 0 and (i == 0 or cells[i - 1][3] != chunk):
            ax.text(c + 0.1, y + 0.75, str(sizes[chunk]), fontsize=4.5, color="#444444",
                    va="bottom")
    ax.set(xlim=(-0.5, n_cols + 0.5), ylim=(-last_row * line_h - 1.2, 1.4))
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")
    ax.figure.savefig(path, dpi=150, bbox_inches="tight")

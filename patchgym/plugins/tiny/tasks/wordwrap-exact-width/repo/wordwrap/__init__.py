"""A minimal greedy word wrapper for plain-text output.

Words are runs of non-whitespace characters; any whitespace between them
(newlines included) collapses to a single space.  Lines are filled
greedily: each word goes on the current line if it fits, otherwise it
starts a new line.
"""

__all__ = ["wrap", "fill", "shorten"]


def wrap(text, width=70, break_long_words=True):
    """Wrap *text* into a list of lines, each at most *width* characters.

    A word longer than *width* is split into chunks of *width* characters
    when *break_long_words* is true, and otherwise placed alone on a line
    that is allowed to overflow.

        >>> wrap("the quick brown fox", 10)
        ['the quick', 'brown fox']
    """
    if width < 1:
        raise ValueError("width must be at least 1, got %r" % (width,))
    lines = []
    current = ""
    for word in text.split():
        if break_long_words and len(word) > width:
            if current:
                lines.append(current)
                current = ""
            while len(word) > width:
                lines.append(word[:width])
                word = word[width:]
        if not current:
            current = word
        elif len(current) + 1 + len(word) < width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def fill(text, width=70, indent=""):
    """Wrap *text* and return it as one string, one line per ``\\n``.

    Every line starts with *indent*, which counts towards *width*.
    """
    if len(indent) >= width:
        raise ValueError("indent must be shorter than width")
    return "\n".join(indent + line for line in wrap(text, width - len(indent)))


def shorten(text, width, placeholder=" [...]"):
    """Collapse whitespace and truncate *text* to fit in *width* characters.

    Whole words are dropped from the end and *placeholder* is appended when
    the text does not fit.
    """
    collapsed = " ".join(text.split())
    if len(collapsed) <= width:
        return collapsed
    room = width - len(placeholder)
    if room < 1:
        raise ValueError("placeholder too large for width")
    first = wrap(collapsed, room, break_long_words=False)[0]
    if len(first) > room:
        return placeholder.lstrip()
    return first + placeholder

"""Strings from outside optiq (kernel and role names from traces, recipe names and summaries, paths, checkpoint
fields, messages of user code) made safe to show: one line, no terminal control sequences, bounded in length.

A kernel name is data, not an instruction to the terminal: a raw ESC would let a trace recolour, move the cursor,
retitle the window or (OSC 8/52) plant links and write the clipboard; a newline would let it forge lines of optiq's
own output; a lone surrogate would crash the write to a UTF-8 stream. Every such character is shown as its Python
escape instead, so the user sees what the file holds. This module imports nothing: the CLI's error path, the rich
views and the Markdown report all use it.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# C0 and C1 controls and DEL; bidirectional overrides and isolates, which reorder what follows them on screen (the
# "Trojan Source" trick); the Unicode line and paragraph separators; lone surrogates, which no UTF-8 stream encodes.
_INVISIBLE = [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
              *range(0x2066, 0x206A), 0x2028, 0x2029, *range(0xD800, 0xE000)]
_ESCAPES = {code: _NAMED.get(chr(code)) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
            for code in _INVISIBLE}

SHOWN_CHARS = 400  # a name longer than this is cut when shown (a table cell, a line); JSON and CSV keep it whole


def visible(value: object, limit: int | None = SHOWN_CHARS) -> str:
    """``str(value)`` with every control, bidi-override, separator and surrogate character written as its escape
    (``\\x1b``, ``\\n``, ``\\u202e``), cut to ``limit`` characters with the count of the rest."""
    text = str(value)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}… (+{len(text) - limit:,} chars)"
    return text.translate(_ESCAPES)

"""Markdown and HTML tables of the fleet report, shared by its sections."""

from __future__ import annotations

import html


def md_table(header, rows):
    def esc(text):
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |"]
    lines.append("|" + "|".join("---" for _column in header) + "|")
    lines.extend("| " + " | ".join(esc(c) for c in row) + " |" for row in rows)
    return "\n".join(lines)


def html_table(header, rows, cls=None):
    esc = html.escape
    out = ["<table%s>" % (' class="%s"' % cls if cls else "")]
    out.append("<tr>" + "".join("<th>%s</th>" % esc(str(h)) for h in header) + "</tr>")
    for row in rows:
        cells = []
        for cell in row:
            text = esc(str(cell))
            if cell in ("PASS", "FAIL"):
                text = '<span class="%s">%s</span>' % (cell.lower(), text)
            cells.append("<td>%s</td>" % text)
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)

"""The fleet report as one document, rendered to HTML and to Markdown by Jinja2 templates.

Every section of the report (report.py, report_containers.py, report_refused.py,
report_drift.py) builds its content once, as a list of blocks; :func:`render_html` and
:func:`render_markdown` turn the same blocks into report.html and report.md with the
templates below. HTML is autoescaped; in Markdown, text and table cells have what a viewer
would act on backslash-escaped (HTML, emphasis, links, pipes) and newlines removed.
Nothing a result file says reaches the page unescaped.

Blocks (dicts with a ``kind``):

- ``heading``: ``level`` (1-3), ``text``, optional ``anchor`` (an HTML id);
- ``para``: ``spans``, each a string or ``{"text", "cls"?, "code"?}`` (``cls`` is
  ``pass``/``fail``/``muted``: bold in Markdown for pass/fail; ``code``: inline code);
- ``note``: ``text``, a warning (HTML ``<p class="fail">``, Markdown ``> **text**``);
- ``table``: ``header``, ``rows`` (cells strings or ``{"text", "cls"}``), ``cls``;
- ``list``: ``entries``, each ``{"spans", "children"}`` (children: a list of span lists);
- ``image``: ``src``, ``alt``.
"""

from __future__ import annotations

import json
from pathlib import Path

try:  # the report renders on the controller, where Ansible's own Jinja2 is
    import jinja2
    from markupsafe import Markup

    JINJA2_IMPORT_ERROR = None
except ImportError as exc:
    jinja2 = Markup = None
    JINJA2_IMPORT_ERROR = exc

STATUS_CLASSES = {"PASS": "pass", "FAIL": "fail", "DRIFT": "fail"}
# What a record that cannot be read or parsed raises; it becomes an entry with ``error``.
RECORD_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)


def load_records(results_dirs, kind, parse):
    """[entry] of one section from every ``<dir>/<kind>/*.json``, in name order:
    ``parse(record)`` builds each entry from the JSON record, and ``source`` says which file
    it came from; a file that cannot be read or parsed is an entry ``{"host", "source",
    "error"}`` (named after the file), so the report still builds and still lists the host."""
    entries = []
    for directory in results_dirs:
        for path in sorted((Path(directory) / kind).glob("*.json")):
            try:
                entry = parse(json.loads(path.read_text(encoding="utf-8")))
            except RECORD_ERRORS as exc:
                entry = {"host": path.stem, "error": str(exc)}
            entries.append({**entry, "source": str(path)})
    return entries


def heading(level, text, anchor=None):
    return {"kind": "heading", "level": level, "text": str(text), "anchor": anchor}


def span(text, cls=None, code=False):
    return {"text": str(text), "cls": cls, "code": code}


def para(*spans):
    return {"kind": "para", "spans": [s if isinstance(s, dict) else str(s) for s in spans]}


def note(text):
    return {"kind": "note", "text": str(text)}


def cell(value):
    """A table cell: PASS, FAIL and DRIFT are marked for the HTML page's colours."""
    if isinstance(value, dict):
        return value
    text = str(value)
    cls = STATUS_CLASSES.get(text)
    return {"text": text, "cls": cls} if cls else text


def table(header, rows, cls=None):
    return {
        "kind": "table",
        "header": [str(h) for h in header],
        "rows": [[cell(c) for c in row] for row in rows],
        "cls": cls,
    }


def item(*spans, children=()):
    return {
        "spans": [s if isinstance(s, dict) else str(s) for s in spans],
        "children": [[c if isinstance(c, dict) else str(c) for c in child] for child in children],
    }


def bullets(items):
    return {"kind": "list", "entries": list(items)}


def image(src, alt):
    return {"kind": "image", "src": str(src), "alt": str(alt)}


# What a Markdown viewer would act on in a host's string: HTML tags and entities (< &),
# emphasis, links and images, code spans, table pipes. CommonMark renders any of them
# literally behind a backslash. (">" acts only at a line's start, where no string lands.)
_MD_ACTIVE = "\\`*_[]<&|~"


def _md_text(value):
    text = str(value).replace("\n", " ")
    return "".join("\\" + c if c in _MD_ACTIVE else c for c in text)


def _md_cell(value):
    return _md_text(value["text"] if isinstance(value, dict) else value)


def _md_code(value):
    return "`%s`" % str(value).replace("`", "'").replace("\n", " ")


HTML_TEMPLATE = """\
{%- macro spans(items) -%}
{%- for s in items -%}
{%- if s is string %}{{ s }}
{%- elif s.code %}<code>{{ s.text }}</code>
{%- elif s.cls %}<span class="{{ s.cls }}">{{ s.text }}</span>
{%- else %}{{ s.text }}{% endif -%}
{%- endfor -%}
{%- endmacro -%}
{%- macro cell(c) -%}
{%- if c is string %}{{ c }}
{%- elif c.cls %}<span class="{{ c.cls }}">{{ c.text }}</span>
{%- else %}{{ c.text }}{% endif -%}
{%- endmacro -%}
<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{{ title }}</title>
<style>{{ css }}</style></head><body>
{% for b in blocks -%}
{% if b.kind == "heading" -%}
<h{{ b.level }}{% if b.anchor %} id="{{ b.anchor }}"{% endif %}>{{ b.text }}</h{{ b.level }}>
{% elif b.kind == "para" -%}
<p>{{ spans(b.spans) }}</p>
{% elif b.kind == "note" -%}
<p class="fail">{{ b.text }}</p>
{% elif b.kind == "table" -%}
<table{% if b.cls %} class="{{ b.cls }}"{% endif %}>
<tr>{% for h in b.header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in b.rows -%}
<tr>{% for c in row %}<td>{{ cell(c) }}</td>{% endfor %}</tr>
{% endfor -%}
</table>
{% elif b.kind == "list" -%}
<ul>
{% for i in b.entries -%}
<li>{{ spans(i.spans) }}
{%- if i.children %}<ul>
{%- for c in i.children %}<li>{{ spans(c) }}</li>{% endfor -%}
</ul>{% endif -%}
</li>
{% endfor -%}
</ul>
{% elif b.kind == "image" -%}
<p><img src="{{ b.src }}" alt="{{ b.alt }}"></p>
{% endif -%}
{% endfor -%}
</body></html>
"""

MARKDOWN_TEMPLATE = """\
{%- macro spans(items) -%}
{%- for s in items -%}
{%- if s is string %}{{ s | md_text }}
{%- elif s.code %}{{ s.text | md_code }}
{%- elif s.cls in ("pass", "fail") %}**{{ s.text | md_text }}**
{%- else %}{{ s.text | md_text }}{% endif -%}
{%- endfor -%}
{%- endmacro -%}
{%- for b in blocks -%}
{%- if not loop.first %}

{% endif -%}
{%- if b.kind == "heading" -%}
{{ "#" * b.level }} {{ b.text | md_text }}
{%- elif b.kind == "para" -%}
{{ spans(b.spans) }}
{%- elif b.kind == "note" -%}
> **{{ b.text | md_text }}**
{%- elif b.kind == "table" -%}
| {{ b.header | map("md_cell") | join(" | ") }} |
|{% for h in b.header %}---{% if not loop.last %}|{% endif %}{% endfor %}|
{%- for row in b.rows %}
| {{ row | map("md_cell") | join(" | ") }} |
{%- endfor -%}
{%- elif b.kind == "list" -%}
{%- for i in b.entries -%}
{%- if not loop.first %}
{% endif -%}
- {{ spans(i.spans) }}
{%- for c in i.children %}
  - {{ spans(c) }}
{%- endfor -%}
{%- endfor -%}
{%- elif b.kind == "image" -%}
![{{ b.alt | md_text }}]({{ b.src }})
{%- endif -%}
{%- endfor %}
"""


def _environment(autoescape):
    env = jinja2.Environment(
        autoescape=autoescape,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters.update(md_cell=_md_cell, md_text=_md_text, md_code=_md_code)
    return env


_TEMPLATES = {}


def _template(name):
    if JINJA2_IMPORT_ERROR is not None:
        raise RuntimeError(
            "the report needs Jinja2 (and markupsafe) on the controller: %s" % JINJA2_IMPORT_ERROR
        )
    if name not in _TEMPLATES:
        source = HTML_TEMPLATE if name == "html" else MARKDOWN_TEMPLATE
        _TEMPLATES[name] = _environment(name == "html").from_string(source)
    return _TEMPLATES[name]


def render_html(blocks, title, css):
    """report.html; ``css`` is the report's own style sheet (trusted, not escaped)."""
    return _template("html").render(blocks=blocks, title=title, css=Markup(css))


def render_markdown(blocks):
    return _template("markdown").render(blocks=blocks)

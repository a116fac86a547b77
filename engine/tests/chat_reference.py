"""Reference rendering of chat templates for engine/tests/chat_templates.rs.

Renders with Python's Jinja2 configured as Hugging Face `transformers` documents its
`apply_chat_template`: a sandboxed environment with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, a `raise_exception` global, a `strftime_now` global and a `tojson`
filter that keeps non-ASCII text. Reads one JSON object from stdin:
  {"cases": [{"source": ..., "messages": [...], "add_generation_prompt": bool,
              "bos_token": ..., "eos_token": ...}, ...]}
and writes a JSON list with {"text": ...} or {"raised": message} or {"error": message} per case.
"""

import json
import sys
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Raised(Exception):
    pass


def raise_exception(message):
    raise Raised(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = {}
    out = []
    for case in json.load(sys.stdin)["cases"]:
        try:
            src = case["source"]
            if src not in compiled:
                compiled[src] = env.from_string(src)
            # As apply_chat_template: `tools` and `documents` are passed, None when absent.
            text = compiled[src].render(messages=case["messages"], tools=None, documents=None,
                                        add_generation_prompt=case["add_generation_prompt"],
                                        bos_token=case["bos_token"],
                                        eos_token=case["eos_token"])
            out.append({"text": text})
        except Raised as e:
            out.append({"raised": str(e)})
        except jinja2.TemplateError as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
        except Exception as e:  # templates index missing keys, call methods on None, ...
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

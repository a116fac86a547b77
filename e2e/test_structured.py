"""Structured output and tool calling with the official `openai` client against `cleave up`
(1 prefill + 2 decode workers): pydantic parsing, strict JSON schemas checked with `jsonschema`,
tool calls (required, named, auto; whole and streamed), a tool-result turn, 16 concurrent
requests with 16 different schemas, and disaggregated constrained output equal to the single
process's."""

import json
import re
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def obj(props, required=None):
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def s(n=16):
    return {"type": "string", "maxLength": n}


def i(lo=0, hi=1000):
    return {"type": "integer", "minimum": lo, "maximum": hi}


def num():
    return {"type": "number", "minimum": -1000, "maximum": 1000}


# Twenty strict schemas: nesting, enums, arrays, anyOf, numbers, booleans, nulls, const.
SCHEMAS = [
    obj({"name": s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": s(), "country": s(), "population": i(0, 10_000_000)}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"tags": {"type": "array", "items": s(10), "minItems": 1, "maxItems": 3}}),
    obj({"ok": {"type": "boolean"}, "reason": s(20)}),
    obj({"point": obj({"x": num(), "y": num()})}),
    obj({"value": {"anyOf": [i(), {"type": "null"}]}}),
    obj({"kind": {"const": "fruit"}, "name": s()}),
    obj({"items": {"type": "array", "items": obj({"id": i(), "label": s(8)}), "maxItems": 2}}),
    obj({"title": s(24), "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    obj({"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"first": s(), "last": s(), "email": s(24)}),
    obj({"steps": {"type": "array", "items": s(12), "maxItems": 3}}),
    obj({"temperature": num(), "unit": {"enum": ["C", "F"]}}),
    obj({"user": obj({"name": s(), "admin": {"type": "boolean"}})}),
    obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "maxItems": 4}}),
    obj({"language": s(12), "typed": {"type": "boolean"}, "year": i(1900, 2100)}),
    obj({"status": {"anyOf": [{"const": "active"}, {"const": "inactive"}]}, "count": i()}),
    obj({"a": s(4), "b": s(4), "c": s(4), "d": s(4)}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 5},
]


def schema_request(client, model_name, i, schema):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": f"Give example {i} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        temperature=0,
        max_tokens=200,
    )
    return r.choices[0]


def test_parse_returns_a_pydantic_object(client, model_name):
    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        # Bounded, as every number here: a 135M model repeats digits forever otherwise.
        population: int = Field(ge=0, le=100_000_000)

    r = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=100,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_requests_with_twenty_strict_schemas_all_validate(client, model_name):
    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(lambda a: schema_request(client, model_name, *a), enumerate(SCHEMAS)))
    for i, (schema, c) in enumerate(zip(SCHEMAS, choices)):
        assert c.finish_reason == "stop", (i, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)


def test_json_object_regex_and_choice(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=120
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=model_name, prompt="A phone number: ", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
        temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")


def check_call(call, names):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_and_named_tool_calls_are_valid(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=150
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        check_call(call, {"get_weather", "get_time"})
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=150,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    check_call(c.message.tool_calls[0], {"get_time"})


def test_auto_gives_either_text_or_valid_calls(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80
    )
    m = r.choices[0].message
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in m.tool_calls:
            check_call(call, {"get_weather"})
    else:
        assert isinstance(m.content, str) and m.content


def test_streamed_tool_call_deltas_assemble_into_valid_arguments(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=150, stream=True, parallel_tool_calls=False,
    )
    calls, finish, fragments = {}, None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
            if tc.id:
                entry["id"], entry["name"] = tc.id, tc.function.name
            entry["args"] += tc.function.arguments or ""
            fragments += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["args"]), PARAMS["get_weather"])
    assert fragments > 2, "arguments should stream in fragments"
    # The same request whole gives the same arguments.
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=150, parallel_tool_calls=False,
    )
    assert r.choices[0].message.tool_calls[0].function.arguments == calls[0]["args"]


def test_a_tool_result_turn_continues_the_conversation(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=150
    )
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    r = client.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40)
    m = r.choices[0].message
    assert m.content or m.tool_calls
    assert r.usage.prompt_tokens > 60


def placements(cluster, mode):
    body = urllib.request.urlopen(f"http://127.0.0.1:{cluster['port']}/metrics").read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith("cleave_router_placements_total") and f'mode="{mode}"' in line:
            total += float(line.split()[-1])
    return total


def test_disaggregated_constrained_output_equals_the_single_process(cluster, client, model_name, cleave_bin):
    # Long enough (> 9 blocks of 16 tokens) to be prefilled on the prefill worker.
    prompt = "Here is a report about a city. " + "The city has a river, a market and a museum. " * 25 + "Describe the city as JSON."
    schema = SCHEMAS[1]
    before = placements(cluster, "disaggregated")
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    assert placements(cluster, "disaggregated") == before + 1
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    out = subprocess.run(
        [cleave_bin, "generate", "--chat", "--prompt", prompt, "--max-tokens", "120", "--json",
         "--json-schema", json.dumps(schema)],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(out.stdout)["text"] == text


def test_bad_schemas_and_tools_are_400s(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_name, messages=ASK, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
        )
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_name, messages=ASK, max_tokens=5, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch_rocket"}},
        )
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model_name, prompt="x", max_tokens=5, extra_body={"structured_outputs": {"grammar": "start: missing"}}
        )
    assert e.value.body["param"] == "structured_outputs.grammar"


def test_n_seed_stop_logprobs_and_usage_keep_working_under_a_schema(client, model_name):
    schema = SCHEMAS[0]
    kw = dict(
        model=model_name, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    r = client.chat.completions.create(n=2, temperature=0.9, seed=7, logprobs=True, top_logprobs=2, **kw)
    again = client.chat.completions.create(n=2, temperature=0.9, seed=7, logprobs=True, top_logprobs=2, **kw)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema)
        assert len(c.logprobs.content) > 0 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    # A stop string cuts the constrained output where it appears.
    r = client.chat.completions.create(temperature=0, stop=[", "], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert ", " not in r.choices[0].message.content
    assert r.choices[0].message.content.startswith('{"name": ')

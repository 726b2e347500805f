"""Generate the bundled demo corpus, its frozen split and its evaluation windows.

Every document is written by this script from its own templates and word lists,
so the demo carries no text copied from anywhere else and can be rebuilt bit for
bit. The four strata mirror the ones the audit evaluates on:

- ``ops``: terminal sessions, code in several languages, stack traces, configs;
- ``chat_json``: chat transcripts with a ``<tools>`` system block, tool calls
  as JSON, and JSON-extraction answers;
- ``ja``: Japanese prose (kanji, hiragana and katakana mixed);
- ``persona``: role-play dialogue between named characters with distinct voices.

Real corpora share boilerplate across documents, and the overlap audit exists
to report it, so the generator reproduces that hazard on purpose: most
``chat_json`` documents open with one of a few identical ``<tools>`` blocks and
many ``ops`` documents start with the same license header. The split is still
clean at the document level.

Outputs (``python demo/corpus/generate.py``, run from anywhere):
``demo/docs.jsonl``, ``demo/split.csv`` and, once ``demo/tokenizer.json``
exists, ``demo/windows.csv`` (windows are placed by token counts, which need
the tokenizer the demo model was trained with). Training-only documents come
from the same generators under other seeds (``iter_docs(seed, n, "train_")``,
used by ``demo/train/gather_text.py``) and are never part of the split.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent.parent
STRATA: tuple[str, ...] = ("ops", "chat_json", "ja", "persona")
DOCS_PER_STRATUM = 125
CORPUS_SEED = 20240611
# Shares of each stratum's documents per role; the remainder is "unused".
ROLE_SHARES: tuple[tuple[str, float], ...] = (("cal", 0.45), ("eval", 0.20), ("canary", 0.05))
EVAL_WINDOWS_PER_STRATUM = 8
CANARY_WINDOWS_PER_STRATUM = 3
WINDOW_SEED = 7
WINDOW_NGRAM = 16  # the audit's n: a scored span shares no n-gram with calibration documents

# --------------------------------------------------------------------------- shared vocabulary

NOUNS = ["cache", "queue", "index", "ledger", "invoice", "sensor", "router", "bucket", "shard", "token",
         "session", "report", "order", "ticket", "profile", "image", "stream", "batch", "worker", "job",
         "metric", "alert", "payload", "record", "schema", "snapshot", "replica", "volume", "lease", "quota"]
VERBS = ["load", "parse", "flush", "merge", "fetch", "render", "encode", "decode", "resolve", "compact",
         "sync", "validate", "publish", "collect", "rotate", "prune", "split", "build", "scan", "emit"]
ADJS = ["stale", "pending", "active", "remote", "local", "cached", "primary", "shadow", "draft", "frozen"]
HOSTS = ["build-01", "gpu-node-3", "db-primary", "edge-eu-2", "ci-runner-7", "staging-api", "lab-ws-12"]
USERS = ["mika", "deploy", "root", "ana", "tkato", "ci", "jules", "priya"]
FIRST_NAMES = ["Aiko", "Bruno", "Chloe", "Dmitri", "Esme", "Farid", "Greta", "Hiro", "Ines", "Jonas",
               "Kaito", "Lena", "Mateo", "Noor", "Oskar", "Paula", "Quentin", "Rina", "Sven", "Talia"]
LAST_NAMES = ["Arai", "Berger", "Costa", "Duval", "Eriksen", "Fujita", "Garcia", "Hoffmann", "Ito",
              "Jensen", "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quinn", "Rossi"]
CITIES = ["Osaka", "Lyon", "Porto", "Tallinn", "Sapporo", "Ghent", "Bergen", "Kraków", "Valencia", "Nagoya",
          "Leipzig", "Tampere", "Bologna", "Kobe", "Utrecht"]
PRODUCTS = ["trail shoes", "espresso grinder", "desk lamp", "rain jacket", "mechanical keyboard",
            "bicycle pump", "tea kettle", "noise-cancelling headphones", "cast-iron pan", "backpack"]

LICENSE_HEADER = (
    "# Copyright (c) 2019-2024 The Lanternfish Project Authors.\n"
    "#\n"
    "# Licensed under the Apache License, Version 2.0 (the \"License\");\n"
    "# you may not use this file except in compliance with the License.\n"
    "# You may obtain a copy of the License at\n"
    "#\n"
    "#     http://www.apache.org/licenses/LICENSE-2.0\n"
    "#\n"
    "# Unless required by applicable law or agreed to in writing, software\n"
    "# distributed under the License is distributed on an \"AS IS\" BASIS,\n"
    "# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.\n"
    "# See the License for the specific language governing permissions and\n"
    "# limitations under the License.\n"
)


def pick(rng: random.Random, items: list[str]) -> str:
    """One item, drawn with the document's own generator so output stays reproducible."""
    return items[rng.randrange(len(items))]


def ident(rng: random.Random) -> str:
    """A snake_case identifier such as ``flush_stale_cache``."""
    return f"{pick(rng, VERBS)}_{pick(rng, ADJS)}_{pick(rng, NOUNS)}"


def camel(rng: random.Random) -> str:
    """A CamelCase type name such as ``ShadowLedgerWorker``."""
    return pick(rng, ADJS).capitalize() + pick(rng, NOUNS).capitalize() + pick(rng, ["Service", "Store", "Worker", "Client", "Manager"])


def hexid(rng: random.Random, n: int) -> str:
    """A lowercase hex string of ``n`` digits (commit hashes, container ids)."""
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def person(rng: random.Random) -> str:
    """A full name from the shared lists."""
    return f"{pick(rng, FIRST_NAMES)} {pick(rng, LAST_NAMES)}"


# --------------------------------------------------------------------------- ops

def shell_session(rng: random.Random) -> str:
    """A terminal transcript: prompt lines with plausible commands and their output."""
    user, host = pick(rng, USERS), pick(rng, HOSTS)
    proj = pick(rng, ["lanternfish", "orbit", "tidepool", "kestrel", "mosaic"])
    prompt = f"{user}@{host}:~/{proj}$ "
    out: list[str] = []
    for _ in range(rng.randint(3, 7)):
        kind = rng.randrange(8)
        if kind == 0:
            out.append(prompt + "git status")
            out.append(f"On branch {pick(rng, ['main', 'fix/' + ident(rng), 'feat/' + pick(rng, NOUNS)])}")
            out.append("Changes not staged for commit:")
            for _ in range(rng.randint(1, 4)):
                out.append(f"\tmodified:   src/{pick(rng, NOUNS)}/{ident(rng)}.py")
        elif kind == 1:
            out.append(prompt + "ls -la " + pick(rng, ["build", "src", "logs", "data"]))
            out.append(f"total {rng.randint(8, 400)}")
            for _ in range(rng.randint(3, 6)):
                size = rng.randint(120, 99999)
                out.append(f"-rw-r--r-- 1 {user} {user} {size:>6} {pick(rng, ['Jan', 'Mar', 'Jun', 'Oct'])} "
                           f"{rng.randint(1, 28):>2} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {ident(rng)}.{pick(rng, ['log', 'json', 'py', 'csv'])}")
        elif kind == 2:
            n_pass, n_fail = rng.randint(10, 240), rng.choice([0, 0, 1, 2])
            out.append(prompt + f"python -m pytest -q tests/test_{pick(rng, NOUNS)}.py")
            out.append("." * min(n_pass, 60) + ("F" * n_fail))
            if n_fail:
                out.append(f"FAILED tests/test_{pick(rng, NOUNS)}.py::test_{ident(rng)} - AssertionError: "
                           f"expected {rng.randint(1, 99)}, got {rng.randint(100, 999)}")
            out.append(f"{n_pass} passed{', ' + str(n_fail) + ' failed' if n_fail else ''} in {rng.uniform(0.3, 42.0):.2f}s")
        elif kind == 3:
            out.append(prompt + "docker ps --format 'table {{.ID}}\\t{{.Image}}\\t{{.Status}}'")
            out.append("CONTAINER ID   IMAGE                    STATUS")
            for _ in range(rng.randint(1, 4)):
                out.append(f"{hexid(rng, 12)}   {pick(rng, ['postgres:16', 'redis:7', 'nginx:1.25', proj + ':dev'])}"
                           f"{' ' * 8}Up {rng.randint(2, 59)} {pick(rng, ['minutes', 'hours', 'days'])}")
        elif kind == 4:
            out.append(prompt + f"kubectl get pods -n {proj}")
            out.append("NAME                               READY   STATUS             RESTARTS   AGE")
            for _ in range(rng.randint(2, 5)):
                status = rng.choice(["Running", "Running", "Running", "CrashLoopBackOff", "Pending"])
                out.append(f"{proj}-{pick(rng, NOUNS)}-{hexid(rng, 5)}    1/1     {status:<18} {rng.randint(0, 9):<10} {rng.randint(1, 90)}m")
        elif kind == 5:
            out.append(prompt + f"grep -rn '{pick(rng, NOUNS)}' src/ | head -n 3")
            for _ in range(3):
                out.append(f"src/{ident(rng)}.py:{rng.randint(1, 400)}:    {ident(rng)}(self.{pick(rng, NOUNS)})")
        elif kind == 6:
            out.append(prompt + f"curl -s http://localhost:{rng.choice([8000, 8080, 9090])}/health | jq .")
            out.append(json.dumps({"status": rng.choice(["ok", "degraded"]), "uptime_s": rng.randint(10, 999999),
                                   "version": f"{rng.randint(0, 3)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"}, indent=2))
        else:
            out.append(prompt + f"git log --oneline -n {rng.randint(3, 5)}")
            for _ in range(rng.randint(3, 5)):
                out.append(f"{hexid(rng, 7)} {pick(rng, ['Fix', 'Add', 'Refactor', 'Speed up', 'Document'])} "
                           f"{ident(rng).replace('_', ' ')}")
    return "\n".join(out) + "\n"


def python_snippet(rng: random.Random) -> str:
    """A small Python module with a dataclass, a function and a loop."""
    cls, fn, field = camel(rng), ident(rng), pick(rng, NOUNS)
    lines = [
        "from dataclasses import dataclass, field",
        "from typing import Iterable",
        "",
        "",
        "@dataclass",
        f"class {cls}:",
        f'    """Keeps track of {field} entries for the {pick(rng, ADJS)} path."""',
        "",
        f"    name: str",
        f"    limit: int = {rng.choice([8, 16, 64, 256, 1024])}",
        f"    items: list[str] = field(default_factory=list)",
        "",
        f"    def {pick(rng, VERBS)}(self, values: Iterable[str]) -> int:",
        "        added = 0",
        "        for value in values:",
        "            if len(self.items) >= self.limit:",
        f"                raise ValueError(f\"{{self.name}}: {field} limit {{self.limit}} reached\")",
        "            if value not in self.items:",
        "                self.items.append(value)",
        "                added += 1",
        "        return added",
        "",
        "",
        f"def {fn}(records: list[dict], threshold: float = {rng.uniform(0.1, 0.9):.2f}) -> dict[str, float]:",
        f'    """Average the {pick(rng, NOUNS)} score per key, skipping rows below the threshold."""',
        "    totals: dict[str, float] = {}",
        "    counts: dict[str, int] = {}",
        "    for row in records:",
        "        score = float(row.get(\"score\", 0.0))",
        "        if score < threshold:",
        "            continue",
        "        key = row[\"key\"]",
        "        totals[key] = totals.get(key, 0.0) + score",
        "        counts[key] = counts.get(key, 0) + 1",
        "    return {k: totals[k] / counts[k] for k in totals}",
    ]
    return "```python\n" + "\n".join(lines) + "\n```\n"


def rust_snippet(rng: random.Random) -> str:
    """A Rust struct with an impl block and a unit test."""
    ty, field = camel(rng), pick(rng, NOUNS)
    cap = rng.choice([4, 32, 128, 4096])
    return f"""```rust
use std::collections::HashMap;

#[derive(Debug, Default)]
pub struct {ty} {{
    {field}s: HashMap<String, u64>,
    capacity: usize,
}}

impl {ty} {{
    pub fn new(capacity: usize) -> Self {{
        Self {{ {field}s: HashMap::with_capacity(capacity), capacity }}
    }}

    pub fn {pick(rng, VERBS)}(&mut self, key: &str, delta: u64) -> Result<u64, String> {{
        if self.{field}s.len() >= self.capacity && !self.{field}s.contains_key(key) {{
            return Err(format!("{{}}: capacity {{}} exceeded", key, self.capacity));
        }}
        let entry = self.{field}s.entry(key.to_string()).or_insert(0);
        *entry += delta;
        Ok(*entry)
    }}
}}

#[cfg(test)]
mod tests {{
    use super::*;

    #[test]
    fn rejects_overflow() {{
        let mut s = {ty}::new({cap});
        for i in 0..{cap} {{
            s.{pick(rng, VERBS)}(&format!("k{{}}", i), 1).unwrap();
        }}
    }}
}}
```
"""


def csharp_snippet(rng: random.Random) -> str:
    """A C# class with an async method."""
    ty, field = camel(rng), pick(rng, NOUNS)
    return f"""```csharp
using System;
using System.Collections.Generic;
using System.Threading.Tasks;

namespace Lanternfish.{pick(rng, NOUNS).capitalize()}
{{
    public sealed class {ty}
    {{
        private readonly Dictionary<string, int> _{field}Counts = new();
        private readonly int _limit = {rng.randint(2, 500)};

        public async Task<int> {pick(rng, VERBS).capitalize()}Async(string key)
        {{
            await Task.Delay({rng.randint(1, 250)});
            if (!_{field}Counts.TryGetValue(key, out var count))
            {{
                count = 0;
            }}
            if (count >= _limit)
            {{
                throw new InvalidOperationException($"{{key}} hit the {field} limit");
            }}
            _{field}Counts[key] = count + 1;
            return count + 1;
        }}
    }}
}}
```
"""


def java_snippet(rng: random.Random) -> str:
    """A Java class with a stream pipeline."""
    ty, field = camel(rng), pick(rng, NOUNS)
    return f"""```java
package org.lanternfish.{pick(rng, NOUNS)};

import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;

public final class {ty} {{
    private final int threshold;

    public {ty}(int threshold) {{
        this.threshold = threshold;
    }}

    public Map<String, Long> {pick(rng, VERBS)}{field.capitalize()}s(List<String> lines) {{
        return lines.stream()
                .filter(line -> line.length() > threshold)
                .map(line -> line.split(",")[{rng.randint(0, 3)}])
                .collect(Collectors.groupingBy(s -> s, Collectors.counting()));
    }}
}}
```
"""


def stack_trace(rng: random.Random) -> str:
    """A Python or Java stack trace with plausible frames."""
    if rng.random() < 0.6:
        frames = []
        for _ in range(rng.randint(3, 6)):
            frames.append(f'  File "/srv/app/{pick(rng, NOUNS)}/{ident(rng)}.py", line {rng.randint(10, 900)}, in {ident(rng)}')
            frames.append(f"    {pick(rng, ['return', 'result =', 'self.state ='])} {ident(rng)}({pick(rng, NOUNS)})")
        err = rng.choice([f"KeyError: '{pick(rng, NOUNS)}'", "ZeroDivisionError: division by zero",
                          f"ValueError: invalid literal for int() with base 10: '{pick(rng, ADJS)}'",
                          f"TimeoutError: {pick(rng, NOUNS)} did not respond within {rng.randint(1, 60)}s"])
        return "Traceback (most recent call last):\n" + "\n".join(frames) + "\n" + err + "\n"
    frames = [f"\tat org.lanternfish.{pick(rng, NOUNS)}.{camel(rng)}.{pick(rng, VERBS)}({camel(rng)}.java:{rng.randint(10, 700)})"
              for _ in range(rng.randint(3, 7))]
    return (f"Exception in thread \"{pick(rng, ['main', 'worker-3', 'pool-1-thread-2'])}\" java.lang.IllegalStateException: "
            f"{pick(rng, NOUNS)} is {pick(rng, ADJS)}\n" + "\n".join(frames) + "\n")


def config_file(rng: random.Random) -> str:
    """A YAML, TOML or INI configuration file."""
    kind = rng.randrange(3)
    if kind == 0:
        return (f"```yaml\nservice:\n  name: {pick(rng, NOUNS)}-api\n  replicas: {rng.randint(1, 12)}\n"
                f"  image: registry.local/{pick(rng, NOUNS)}:{rng.randint(1, 9)}.{rng.randint(0, 30)}\n"
                f"  resources:\n    cpu: \"{rng.choice(['250m', '500m', '2'])}\"\n    memory: {rng.choice(['256Mi', '1Gi', '4Gi'])}\n"
                f"  env:\n    LOG_LEVEL: {rng.choice(['debug', 'info', 'warn'])}\n    {pick(rng, NOUNS).upper()}_TTL: \"{rng.randint(5, 3600)}\"\n```\n")
    if kind == 1:
        return (f"```toml\n[server]\nhost = \"0.0.0.0\"\nport = {rng.choice([8000, 8443, 5000])}\nworkers = {rng.randint(1, 32)}\n\n"
                f"[{pick(rng, NOUNS)}]\nenabled = {rng.choice(['true', 'false'])}\nretention_days = {rng.randint(1, 365)}\n"
                f"path = \"/var/lib/{pick(rng, NOUNS)}\"\n```\n")
    return (f"```ini\n[{pick(rng, NOUNS)}]\ntimeout = {rng.randint(1, 120)}\nretries = {rng.randint(0, 8)}\n"
            f"backend = {pick(rng, ['sqlite', 'postgres', 'redis'])}\n\n[logging]\nlevel = {rng.choice(['INFO', 'DEBUG'])}\n```\n")


OPS_PROSE = [
    "The {noun} job started failing after the last deploy on {host}; here is what I ran.",
    "Notes from debugging the {adj} {noun} path. The first attempt did not reproduce the issue.",
    "Reproducing the flaky test locally. It only fails when the {noun} is {adj}.",
    "Runbook: how to {verb} the {noun} without downtime.",
    "Postmortem draft: the {noun} queue grew until the worker on {host} ran out of memory.",
    "Quick check before merging the branch that changes how we {verb} {noun}s.",
]


def ops_doc(rng: random.Random) -> str:
    """An ops document: prose notes between shell sessions, code, traces and configs."""
    parts: list[str] = []
    if rng.random() < 0.35:
        parts.append(LICENSE_HEADER)
    parts.append(pick(rng, OPS_PROSE).format(noun=pick(rng, NOUNS), adj=pick(rng, ADJS), verb=pick(rng, VERBS), host=pick(rng, HOSTS)) + "\n")
    makers: list[Callable[[random.Random], str]] = [shell_session, python_snippet, rust_snippet, csharp_snippet,
                                                    java_snippet, stack_trace, config_file, shell_session]
    for _ in range(rng.randint(4, 8)):
        parts.append(makers[rng.randrange(len(makers))](rng))
        if rng.random() < 0.5:
            parts.append(pick(rng, [
                f"That confirms the {pick(rng, NOUNS)} is not the problem.",
                f"After this change the {pick(rng, NOUNS)} count dropped from {rng.randint(500, 9000)} to {rng.randint(0, 400)}.",
                f"Next step: {pick(rng, VERBS)} the {pick(rng, ADJS)} {pick(rng, NOUNS)} and rerun.",
                "Still failing, but the error moved, which is progress.",
                f"The fix is in {hexid(rng, 7)}; it needs a test before it goes to {pick(rng, HOSTS)}.",
            ]) + "\n")
    return "\n".join(parts)


# --------------------------------------------------------------------------- chat_json

TOOL_SETS: list[list[dict]] = [
    [
        {"name": "get_weather", "description": "Current weather for a city.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}},
        {"name": "search_orders", "description": "Find a customer's orders by email and status.",
         "parameters": {"type": "object", "properties": {"email": {"type": "string"}, "status": {"type": "string", "enum": ["open", "shipped", "returned"]}}, "required": ["email"]}},
        {"name": "create_ticket", "description": "Open a support ticket.",
         "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "priority": {"type": "integer", "minimum": 1, "maximum": 4}, "body": {"type": "string"}}, "required": ["title", "priority"]}},
        {"name": "convert_currency", "description": "Convert an amount between currencies.",
         "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}, "required": ["amount", "from", "to"]}},
    ],
    [
        {"name": "run_sql", "description": "Run a read-only SQL query against the analytics warehouse.",
         "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}},
        {"name": "plot_series", "description": "Plot a time series and return an image id.",
         "parameters": {"type": "object", "properties": {"metric": {"type": "string"}, "days": {"type": "integer"}}, "required": ["metric"]}},
    ],
    [
        {"name": "book_table", "description": "Reserve a restaurant table.",
         "parameters": {"type": "object", "properties": {"restaurant": {"type": "string"}, "people": {"type": "integer"}, "time": {"type": "string"}}, "required": ["restaurant", "people", "time"]}},
        {"name": "find_train", "description": "Find trains between two stations on a date.",
         "parameters": {"type": "object", "properties": {"from": {"type": "string"}, "to": {"type": "string"}, "date": {"type": "string"}}, "required": ["from", "to", "date"]}},
        {"name": "send_message", "description": "Send a chat message to a contact.",
         "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "text": {"type": "string"}}, "required": ["to", "text"]}},
    ],
]


def tools_system_block(tool_set: list[dict]) -> str:
    """The system turn that lists the tools: identical bytes for every document that uses the same set."""
    body = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tool_set)
    return ("<|im_start|>system\nYou are a helpful assistant. You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + body + "\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")


def turn(role: str, text: str) -> str:
    """One chat turn in the ChatML layout the demo tokenizer has special tokens for."""
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def tool_exchange(rng: random.Random, tool_set_index: int) -> str:
    """A user request, the assistant's tool call, the tool's JSON answer and the assistant's reply."""
    email = f"{pick(rng, FIRST_NAMES).lower()}.{pick(rng, LAST_NAMES).lower()}@example.{pick(rng, ['com', 'org', 'jp'])}"
    if tool_set_index == 0:
        case = rng.randrange(4)
        if case == 0:
            city = pick(rng, CITIES)
            call = {"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}
            result = {"city": city, "temp_c": round(rng.uniform(-8, 34), 1), "conditions": rng.choice(["rain", "clear", "overcast", "snow"])}
            ask = f"What's the weather like in {city} right now?"
            reply = f"It is {result['temp_c']} °C in {city} with {result['conditions']}."
        elif case == 1:
            status = rng.choice(["open", "shipped", "returned"])
            call = {"name": "search_orders", "arguments": {"email": email, "status": status}}
            orders = [{"id": f"ORD-{rng.randint(10000, 99999)}", "item": pick(rng, PRODUCTS), "total": round(rng.uniform(9, 400), 2)} for _ in range(rng.randint(0, 3))]
            result = {"orders": orders}
            ask = f"Can you check which of my orders are {status}? My email is {email}."
            reply = (f"You have {len(orders)} {status} order{'s' if len(orders) != 1 else ''}: " + ", ".join(f"{o['id']} ({o['item']})" for o in orders) + ".") if orders else f"I found no {status} orders for {email}."
        elif case == 2:
            prio = rng.randint(1, 4)
            title = f"{pick(rng, PRODUCTS).capitalize()} arrived {pick(rng, ['damaged', 'late', 'without a manual', 'in the wrong colour'])}"
            call = {"name": "create_ticket", "arguments": {"title": title, "priority": prio, "body": f"Customer {email} reports: {title.lower()}."}}
            result = {"ticket_id": rng.randint(1000, 9999), "status": "created"}
            ask = f"My {title.lower()}. Please open a ticket, priority {prio}."
            reply = f"Done: ticket #{result['ticket_id']} is open with priority {prio}."
        else:
            amount, cur_from, cur_to = round(rng.uniform(5, 2000), 2), pick(rng, ["EUR", "USD", "JPY", "GBP"]), pick(rng, ["SEK", "PLN", "CHF", "JPY"])
            rate = rng.uniform(0.005, 160)
            call = {"name": "convert_currency", "arguments": {"amount": amount, "from": cur_from, "to": cur_to}}
            result = {"amount": round(amount * rate, 2), "currency": cur_to, "rate": round(rate, 4)}
            ask = f"How much is {amount} {cur_from} in {cur_to}?"
            reply = f"{amount} {cur_from} is about {result['amount']} {cur_to} (rate {result['rate']})."
    elif tool_set_index == 1:
        metric = pick(rng, ["signups", "churn", "revenue", "latency_p95", "active_users"])
        days = rng.choice([7, 14, 30, 90])
        if rng.random() < 0.5:
            call = {"name": "run_sql", "arguments": {"query": f"SELECT day, SUM({metric}) AS v FROM daily_{pick(rng, NOUNS)} WHERE day >= CURRENT_DATE - {days} GROUP BY day ORDER BY day", "limit": days}}
            result = {"rows": [[f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)}", rng.randint(10, 5000)] for _ in range(3)], "truncated": True}
            reply = f"Here are the first rows of {metric} for the last {days} days; the series peaks at {max(r[1] for r in result['rows'])}."
        else:
            call = {"name": "plot_series", "arguments": {"metric": metric, "days": days}}
            result = {"image_id": f"img_{hexid(rng, 8)}"}
            reply = f"I plotted {metric} over {days} days (image {result['image_id']})."
        ask = f"Show me {metric.replace('_', ' ')} for the past {days} days."
    else:
        case = rng.randrange(3)
        if case == 0:
            people, time = rng.randint(2, 8), f"{rng.randint(18, 21)}:{rng.choice(['00', '30'])}"
            place = f"{pick(rng, ['Trattoria', 'Izakaya', 'Bistro', 'Taverna'])} {pick(rng, LAST_NAMES)}"
            call = {"name": "book_table", "arguments": {"restaurant": place, "people": people, "time": time}}
            result = {"confirmed": rng.random() < 0.8, "reference": hexid(rng, 6).upper()}
            ask = f"Book {place} for {people} at {time}, please."
            reply = f"Booked, reference {result['reference']}." if result["confirmed"] else f"{place} is full at {time}; shall I try another time?"
        elif case == 1:
            a, b = pick(rng, CITIES), pick(rng, CITIES)
            date = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            call = {"name": "find_train", "arguments": {"from": a, "to": b, "date": date}}
            result = {"trains": [{"dep": f"{rng.randint(5, 22):02d}:{rng.randint(0, 59):02d}", "duration_min": rng.randint(40, 600)} for _ in range(2)]}
            ask = f"Any trains from {a} to {b} on {date}?"
            reply = f"Two options: {result['trains'][0]['dep']} ({result['trains'][0]['duration_min']} min) and {result['trains'][1]['dep']} ({result['trains'][1]['duration_min']} min)."
        else:
            who = person(rng)
            text = f"Running {rng.randint(5, 30)} minutes late, start without me."
            call = {"name": "send_message", "arguments": {"to": who, "text": text}}
            result = {"delivered": True}
            ask = f"Tell {who} I'm running late and they should start without me."
            reply = f"Sent to {who}."
    return (turn("user", ask) + turn("assistant", "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>")
            + turn("tool", json.dumps(result, ensure_ascii=False)) + turn("assistant", reply))


def extraction_exchange(rng: random.Random) -> str:
    """A user paragraph and the assistant's JSON extraction of its fields."""
    name, city = person(rng), pick(rng, CITIES)
    age, product = rng.randint(19, 78), pick(rng, PRODUCTS)
    qty, price = rng.randint(1, 5), round(rng.uniform(8, 350), 2)
    paragraph = (f"{name}, {age}, from {city}, ordered {qty} × {product} at {price} each on "
                 f"{rng.randint(1, 28)} {pick(rng, ['March', 'July', 'October', 'December'])}. "
                 f"{pick(rng, ['They asked for gift wrapping.', 'Delivery should go to the office.', 'The payment was by card.', 'They want an invoice.'])}")
    record = {"name": name, "age": age, "city": city, "items": [{"product": product, "quantity": qty, "unit_price": price}],
              "total": round(qty * price, 2)}
    return (turn("user", "Extract the customer record as JSON with keys name, age, city, items, total.\n\n" + paragraph)
            + turn("assistant", "```json\n" + json.dumps(record, indent=2, ensure_ascii=False) + "\n```"))


def chat_json_doc(rng: random.Random) -> str:
    """A chat transcript: usually a shared tools block, then tool-call and extraction exchanges."""
    parts: list[str] = []
    tool_set_index = rng.choices([0, 1, 2], weights=[0.6, 0.2, 0.2])[0]
    with_tools = rng.random() < 0.8
    if with_tools:
        parts.append(tools_system_block(TOOL_SETS[tool_set_index]))
    else:
        parts.append(turn("system", "You extract structured data. Answer with JSON only."))
    for _ in range(rng.randint(4, 9)):
        if with_tools and rng.random() < 0.7:
            parts.append(tool_exchange(rng, tool_set_index))
        else:
            parts.append(extraction_exchange(rng))
    return "".join(parts)


# --------------------------------------------------------------------------- ja

JA_TOPICS: dict[str, dict[str, list[str]]] = {
    "天気": {
        "subj": ["今朝の空", "梅雨の雨", "台風の影響", "春の風", "冬の冷え込み", "夕方の雷"],
        "pred": ["思ったより強かった", "一日中続いた", "電車のダイヤを乱した", "洗濯物を乾かしてくれなかった", "街の景色を変えた"],
        "extra": ["天気予報によると、週末は晴れるらしい。", "傘を持って出かけたのは正解だった。", "気温は{n}度まで下がった。", "湿度が高く、少し蒸し暑い。"],
    },
    "料理": {
        "subj": ["味噌汁", "肉じゃが", "カレーライス", "焼き魚", "おにぎり", "天ぷら"],
        "pred": ["祖母のレシピで作った", "意外と簡単だった", "家族に好評だった", "少し塩辛くなってしまった", "弱火でじっくり煮込んだ"],
        "extra": ["だしは昆布とかつお節でとる。", "玉ねぎを{n}分ほど炒めると甘みが出る。", "最後に醤油を少しだけ加える。", "冷めてもおいしいのがうれしい。"],
    },
    "自転車": {
        "subj": ["新しいロードバイク", "駅までの通勤", "川沿いのサイクリング", "パンクしたタイヤ", "古いママチャリ"],
        "pred": ["思った以上に快適だった", "朝の楽しみになった", "自分で修理してみた", "坂道で大活躍した", "週末ごとに乗っている"],
        "extra": ["ヘルメットは必ずかぶるようにしている。", "片道{n}キロほどの距離だ。", "チェーンに油をさすと音が静かになった。", "信号の多い道は避けている。"],
    },
    "電車": {
        "subj": ["朝の満員電車", "新幹線の旅", "ローカル線", "終電", "山手線の車窓"],
        "pred": ["今日も混雑していた", "時間どおりに到着した", "のんびりと走っていた", "乗り過ごしそうになった", "意外と空いていた"],
        "extra": ["車内では本を読むことが多い。", "乗り換えに{n}分かかった。", "駅弁を買うのが旅の楽しみだ。", "窓の外に富士山が見えた。"],
    },
    "歴史": {
        "subj": ["江戸時代の町人文化", "明治維新", "古い城下町", "平安時代の貴族", "戦国時代の武将"],
        "pred": ["今も多くの人を引きつけている", "日本の近代化に大きな影響を与えた", "独特の文化を育てた", "教科書でよく取り上げられる", "各地に史跡を残した"],
        "extra": ["当時の人々の暮らしは質素だった。", "資料館には{n}点ほどの展示がある。", "研究者の間でも意見が分かれている。", "古い地図を見ると町の形がよくわかる。"],
    },
    "仕事": {
        "subj": ["新しいプロジェクト", "月曜日の会議", "リモートワーク", "締め切り前の作業", "チームの打ち合わせ"],
        "pred": ["予定より早く終わった", "思ったより長引いた", "集中しやすかった", "みんなで乗り切った", "いい経験になった"],
        "extra": ["資料は{n}ページにまとめた。", "コーヒーを飲みながら作業した。", "上司からの返事を待っている。", "次の目標を決めておいた。"],
    },
}
JA_OPENERS = ["最近、", "昨日は", "先週末、", "久しぶりに", "ある日、", "今年の春、", "子どものころから、"]
JA_CONNECT = ["そして", "しかし", "それでも", "そのため", "ところで", "実は", "とはいえ"]
JA_CLOSERS = ["また来週も続けたいと思う。", "これからも大切にしていきたい。", "次はもっとうまくやれるはずだ。",
              "少しずつ慣れてきた気がする。", "みなさんはどう思いますか。", "ふとそんなことを考えた。"]


def ja_sentence(rng: random.Random, topic: dict[str, list[str]]) -> str:
    """One Japanese sentence from the topic's subjects, predicates and extras."""
    r = rng.random()
    if r < 0.45:
        return f"{pick(rng, JA_OPENERS)}{pick(rng, topic['subj'])}は{pick(rng, topic['pred'])}。"
    if r < 0.75:
        return pick(rng, topic["extra"]).format(n=rng.randint(2, 40))
    if r < 0.9:
        return f"{pick(rng, JA_CONNECT)}、{pick(rng, topic['subj'])}については{pick(rng, topic['pred'])}と言える。"
    return pick(rng, JA_CLOSERS)


def ja_doc(rng: random.Random) -> str:
    """Japanese prose: a title and several paragraphs that wander across two or three topics."""
    names = list(JA_TOPICS)
    chosen = rng.sample(names, rng.randint(2, 3))
    paragraphs = [f"「{chosen[0]}と{chosen[1]}のこと」"]
    for _ in range(rng.randint(14, 26)):
        topic = JA_TOPICS[pick(rng, chosen)]
        paragraphs.append("".join(ja_sentence(rng, topic) for _ in range(rng.randint(3, 7))))
    return "\n\n".join(paragraphs) + "\n"


# --------------------------------------------------------------------------- persona

PERSONAS: list[dict] = [
    {"name": "Captain Mirela Voss", "lines": [
        "Steady as she goes. Report the {noun} status, and keep it short.",
        "I have sailed through worse storms than this {noun} problem.",
        "We hold course until {city}. Nobody touches the {noun} without my word.",
        "Log it: {n} knots, wind from the east, morale holding.",
    ]},
    {"name": "Professor Quill", "lines": [
        "Ah, but consider the {noun} from first principles, my dear.",
        "In my {n} years of teaching, I have seen this {adj} mistake many times.",
        "Fascinating! The {noun} behaves precisely as the theory predicts, more or less.",
        "Write it down, then write it again more clearly. That is the whole method.",
    ]},
    {"name": "Pip the Tinker", "lines": [
        "Ooh, a {adj} {noun}! Can I take it apart? Just a little?",
        "I fixed it! Well, mostly. It only smokes a tiny bit now.",
        "If we bolt a spring to the {noun}, it will go {n} times faster. Probably.",
        "Hand me the small wrench. No, the smaller one. No, the other small one.",
    ]},
    {"name": "Lady Ottoline", "lines": [
        "How perfectly dreadful. One simply does not {verb} a {noun} before tea.",
        "My late husband kept {n} {noun}s in the east wing. I never asked why.",
        "Do sit down, dear. You are making the {noun} nervous.",
        "In {city} we would have handled this with considerably more grace.",
    ]},
    {"name": "Detective Arlo Banks", "lines": [
        "Nobody leaves this room. Somebody here moved the {noun}.",
        "The clock says {n} past nine. The butler says ten. One of them is lying.",
        "I have seen a {adj} {noun} like this once before, in {city}. It ended badly.",
        "Funny thing about alibis: they always fit a little too well.",
    ]},
    {"name": "Juno", "lines": [
        "lol okay but hear me out: what if the {noun} is the villain",
        "I'm not saying it's aliens. I'm saying it's a {adj} {noun}.",
        "ok ok ok. {n} reasons this is fine. reason one: it's fine.",
        "brb grabbing snacks, do NOT solve the mystery without me",
    ]},
    {"name": "Brother Anselm", "lines": [
        "Patience, friend. The {noun} will reveal itself when it is ready.",
        "We copied {n} pages by candlelight before the bell rang.",
        "There is a quiet kind of courage in simply tending the {noun}.",
        "Even a {adj} heart can learn to be still.",
    ]},
]
SCENES = [
    "A storm rattles the windows of an old lighthouse.",
    "The train to {city} has stopped in the middle of a snowy field.",
    "A cluttered workshop smells of oil and burnt toast.",
    "The library is closed, but somebody left a lamp on.",
    "A dinner party, and the {noun} on the table is missing.",
    "Dawn on the deck of a small ship, fog everywhere.",
]


def persona_line(rng: random.Random, character: dict) -> str:
    """One line in the character's voice, with the shared slots filled in."""
    return pick(rng, character["lines"]).format(noun=pick(rng, NOUNS), adj=pick(rng, ADJS), verb=pick(rng, VERBS),
                                                 city=pick(rng, CITIES), n=rng.randint(2, 40))


def persona_doc(rng: random.Random) -> str:
    """A role-play scene: a setting line, then turns among two to four characters."""
    cast = rng.sample(PERSONAS, rng.randint(2, 4))
    lines = ["[Scene] " + pick(rng, SCENES).format(city=pick(rng, CITIES), noun=pick(rng, NOUNS)), ""]
    for _ in range(rng.randint(24, 48)):
        speaker = pick(rng, cast)
        text = persona_line(rng, speaker)
        if rng.random() < 0.35:
            second = persona_line(rng, speaker)
            text += "" if second == text else " " + second
        if rng.random() < 0.15:
            text = f"*{pick(rng, ['glances at the door', 'sighs', 'lowers their voice', 'taps the table', 'laughs'])}* " + text
        lines.append(f"{speaker['name']}: {text}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- corpus, split, windows

MAKERS: dict[str, Callable[[random.Random], str]] = {
    "ops": ops_doc, "chat_json": chat_json_doc, "ja": ja_doc, "persona": persona_doc,
}


def iter_docs(seed: int, per_stratum: int, prefix: str = "") -> Iterator[dict[str, str]]:
    """Documents ``{doc_id, stratum, text}``; each draws from its own generator seeded by (seed, stratum, index)."""
    for stratum in STRATA:
        for i in range(per_stratum):
            rng = random.Random(f"{seed}/{stratum}/{i}")
            yield {"doc_id": f"{prefix}{stratum}_{i:04d}", "stratum": stratum, "text": MAKERS[stratum](rng)}


def assign_roles(docs: list[dict[str, str]], seed: int) -> dict[str, str]:
    """Role per doc, stratified: each stratum is shuffled and cut by ROLE_SHARES, the rest is 'unused'."""
    roles: dict[str, str] = {}
    for stratum in STRATA:
        ids = [d["doc_id"] for d in docs if d["stratum"] == stratum]
        random.Random(f"{seed}/split/{stratum}").shuffle(ids)
        start = 0
        for role, share in ROLE_SHARES:
            count = round(share * len(ids))
            for doc_id in ids[start:start + count]:
                roles[doc_id] = role
            start += count
        for doc_id in ids[start:]:
            roles[doc_id] = "unused"
    return roles


def docs_jsonl(docs: list[dict[str, str]]) -> str:
    """One JSON object per line, UTF-8 kept as is so the file stays readable."""
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)


def split_csv(docs: list[dict[str, str]], roles: dict[str, str]) -> str:
    """``doc_id,role`` in corpus order."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["doc_id", "role"])
    for d in docs:
        writer.writerow([d["doc_id"], roles[d["doc_id"]]])
    return buf.getvalue()


def calibration_ngrams(docs: list[dict[str, str]], roles: dict[str, str], encode: Callable[[str], list[int]],
                       n: int = WINDOW_NGRAM) -> set[tuple[int, ...]]:
    """Every token n-gram of every `cal` document (a superset of any calibration trace)."""
    grams: set[tuple[int, ...]] = set()
    for d in docs:
        if roles[d["doc_id"]] == "cal":
            ids = encode(d["text"])
            grams.update(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return grams


def clean_score_starts(ids: list[int], scored: int, cal_grams: set[tuple[int, ...]],
                       n: int = WINDOW_NGRAM) -> list[int]:
    """Every s such that no n-gram touching [s, s + scored) occurs in a calibration document."""
    starts = range(max(len(ids) - n + 1, 0))
    shared = [tuple(ids[i:i + n]) in cal_grams for i in starts]  # n-gram starting at i is shared
    clean = []
    for s in range(len(ids) - scored + 1):
        touching = shared[max(s - n + 1, 0):min(s + scored, len(shared))]
        if not any(touching):
            clean.append(s)
    return clean


def window_rows(docs: list[dict[str, str]], roles: dict[str, str], encode: Callable[[str], list[int]],
                seed: int) -> list[list]:
    """Evaluation and canary windows: inside one document each, at a seeded offset.

    Each window is ``ctx_tokens`` of context then ``scored_tokens`` scored
    tokens, starting at token ``start`` of its document, so it never crosses a
    document boundary. The scored span shares no n-gram with any `cal`
    document (the audit would refuse it); the context may, which is the
    realistic hazard the overlap table reports (shared boilerplate). Templated
    documents leave few clean spans, so shorter scored spans are tried before a
    document is skipped.
    """
    cal_grams = calibration_ngrams(docs, roles, encode)
    rows: list[list] = []
    for stratum in STRATA:
        for set_name, count in (("eval", EVAL_WINDOWS_PER_STRATUM), ("canary", CANARY_WINDOWS_PER_STRATUM)):
            rng = random.Random(f"{seed}/windows/{stratum}/{set_name}")
            candidates = [d for d in docs if d["stratum"] == stratum and roles[d["doc_id"]] == set_name]
            rng.shuffle(candidates)
            made = 0
            for d in candidates:
                if made == count:
                    break
                ids = encode(d["text"])
                ctx = rng.choice([128, 160, 192, 224, 256])
                for scored in (rng.choice([64, 96, 128]), 48, 32):
                    starts = [s for s in clean_score_starts(ids, scored, cal_grams) if s >= ctx]
                    if starts:
                        score_start = rng.choice(starts)
                        rows.append([f"{set_name}_{stratum}_{made:02d}", d["doc_id"], stratum, set_name, ctx,
                                     scored, score_start - ctx])
                        made += 1
                        break
            if made < count:
                raise RuntimeError(f"only {made} {set_name} windows fit in stratum {stratum}")
    return rows


def windows_csv(rows: list[list]) -> str:
    """``window_id,doc_id,stratum,set,ctx_tokens,scored_tokens,start``."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["window_id", "doc_id", "stratum", "set", "ctx_tokens", "scored_tokens", "start"])
    writer.writerows(rows)
    return buf.getvalue()


def write_demo(out_dir: Path, tokenizer_path: Path | None) -> None:
    """Write docs.jsonl, split.csv and (given a tokenizer) windows.csv into ``out_dir``."""
    docs = list(iter_docs(CORPUS_SEED, DOCS_PER_STRATUM))
    roles = assign_roles(docs, CORPUS_SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "docs.jsonl").write_text(docs_jsonl(docs), encoding="utf-8")
    (out_dir / "split.csv").write_text(split_csv(docs, roles), encoding="utf-8")
    if tokenizer_path is not None and tokenizer_path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_path))
        rows = window_rows(docs, roles, lambda text: tok.encode(text, add_special_tokens=False).ids, WINDOW_SEED)
        (out_dir / "windows.csv").write_text(windows_csv(rows), encoding="utf-8")


def main() -> None:
    """Command line: write the demo files (training documents are drawn by gather_text.py)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_DIR, help="folder for docs.jsonl, split.csv, windows.csv")
    parser.add_argument("--tokenizer", type=Path, default=DEMO_DIR / "tokenizer.json")
    args = parser.parse_args()
    write_demo(args.out, args.tokenizer)


if __name__ == "__main__":
    main()

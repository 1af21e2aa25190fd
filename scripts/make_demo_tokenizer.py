"""Regenerate the shipped demo tokenizer (``envace_jax/text/demo_tokenizer/``).

The demo tokenizer is a small byte-level BPE (vocabulary 2,048) so that tiny models train fast
on CPU. It carries Qwen3's special tokens as single ids and a chat template of our own that
renders the Qwen3 tool-use layout. Everything here is deterministic: running the script twice
writes byte-identical files (a test checks this and that the shipped files are current).

    python scripts/make_demo_tokenizer.py [--out DIR]

Design choices (why):
- Byte-level BPE, no normaliser: any string encodes and ``decode(encode(s)) == s`` exactly,
  which the trajectory invariant (decode -> messages -> render -> same ids) relies on.
- Every ``\\n`` is its own pre-token. All role-switch glue of the chat layout ends in a newline
  or a special token, so no BPE merge can cross a role boundary and the role pieces compose to
  exactly the template's ids whatever text the roles write.
- Digits are split one by one (ids, dates and amounts are common in tool calls).
- A space before a letter or digit is its own token, so a word, name or id is the same token
  after a space, a quote or a newline (`I am Sue`, `{"name": "Sue"}`, `Sue C4 ...`). A small
  policy copies a value from its context by matching identical tokens; with GPT-style
  space-prefixed words it would first have to learn that ` O3` and `"O3` name the same order.
  Prose costs ~20% more tokens for it.
- The training corpus is generated text of a shop / bank / calendar tool-use world, JSON tool
  calls and responses, plain sentences, and oracle conversations of the demo domain (so the
  demo policy, which trains on a CPU in minutes, reads short sequences).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
from pathlib import Path

# The trainer is multi-threaded; one thread keeps the run reproducible beyond doubt.
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
SEED = 20240611
NUM_DIALOGUES = 1500
NUM_SENTENCES = 3000
NUM_PLAIN = 20000
NUM_DEMO_DIALOGUES = 2000

# (content, special): Qwen3 marks the chat-control tokens special and the tool/think tags not
# special (so decoding with skip_special_tokens keeps them).
SPECIAL_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# Our own template for the Qwen3 tool-use layout. Differences from Qwen3's template: no
# <think> handling (assistant content is rendered verbatim, never split or stripped), and the
# tool name is rendered with tojson (identical for ordinary names, still valid JSON otherwise).
CHAT_TEMPLATE = r"""{#- Qwen3 tool-use layout, verbatim (no <think> insertion or stripping). -#}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- (messages[0].content or '') + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        ~ "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and "
        ~ "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        ~ "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
        ~ "<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + (messages[0].content or '') + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- elif message.content is none or message.content is undefined %}
        {%- set content = '' %}
    {%- else %}
        {{- raise_exception('message ' ~ loop.index0 ~ ': content must be a string or null') }}
    {%- endif %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": ' + (tool_call.name | tojson) + ', "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('message ' ~ loop.index0 ~ ': unknown role ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# ---------------------------------------------------------------------------------------------
# The corpus: a small shop / bank / calendar world.

FIRST = "Alice Bob Carol David Emma Frank Grace Henry Iris Jack Karen Liam Maya Noah Olivia".split()
FIRST += "Peter Quinn Rosa Sam Tara Uma Victor Wendy Xavier Yara Zoe Omar Lena Hugo Nina".split()
LAST = "Smith Jones Brown Garcia Miller Davis Wilson Moore Taylor Clark Lewis Walker Young".split()
PRODUCTS = [
    ("wireless mouse", 24.99),
    ("usb-c cable", 9.5),
    ("laptop stand", 39.0),
    ("coffee mug", 12.0),
    ("desk lamp", 45.75),
    ("notebook", 4.2),
    ("backpack", 59.9),
    ("water bottle", 18.0),
    ("headphones", 89.99),
    ("phone case", 15.25),
    ("keyboard", 64.5),
    ("monitor", 219.0),
    ("chair cushion", 27.3),
    ("pen set", 7.99),
]
CATEGORIES = ["electronics", "office", "kitchen", "travel", "accessories"]
ORDER_STATUS = ["pending", "shipped", "delivered", "cancelled", "processing"]
EVENT_TITLES = [
    "team meeting",
    "dentist appointment",
    "lunch with Sam",
    "project review",
    "yoga class",
    "budget planning",
    "call with the bank",
    "flight to Berlin",
    "birthday dinner",
    "standup",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


def _schema(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def _s(desc: str, **extra) -> dict:
    return {"type": "string", "description": desc, **extra}


def _i(desc: str) -> dict:
    return {"type": "integer", "description": desc}


def _n(desc: str) -> dict:
    return {"type": "number", "description": desc}


TOOLS = [
    _schema(
        "search_products",
        "Search the shop catalogue.",
        {
            "query": _s("Free-text query."),
            "category": _s("Category.", enum=CATEGORIES),
            "max_price": _n("Highest price in USD."),
        },
        ["query"],
    ),
    _schema("get_order", "Look up an order by id.", {"order_id": _s("Order id.")}, ["order_id"]),
    _schema(
        "place_order",
        "Order a product for a customer.",
        {
            "customer_id": _s("Customer id."),
            "product_id": _s("Product id."),
            "quantity": _i("How many."),
        },
        ["customer_id", "product_id", "quantity"],
    ),
    _schema(
        "cancel_order",
        "Cancel an order that has not shipped.",
        {"order_id": _s("Order id."), "reason": _s("Why.")},
        ["order_id"],
    ),
    _schema(
        "get_balance",
        "Balance of a bank account.",
        {"account_id": _s("Account id.")},
        ["account_id"],
    ),
    _schema(
        "transfer_money",
        "Transfer money between accounts.",
        {
            "from_account": _s("Source account id."),
            "to_account": _s("Target account id."),
            "amount": _n("Amount in USD."),
            "memo": _s("Optional memo."),
        },
        ["from_account", "to_account", "amount"],
    ),
    _schema(
        "list_transactions",
        "Recent transactions of an account.",
        {"account_id": _s("Account id."), "limit": _i("At most this many.")},
        ["account_id"],
    ),
    _schema("list_events", "Calendar events on a date.", {"date": _s("YYYY-MM-DD.")}, ["date"]),
    _schema(
        "create_event",
        "Create a calendar event.",
        {
            "title": _s("Title."),
            "date": _s("YYYY-MM-DD."),
            "start_time": _s("HH:MM."),
            "duration_minutes": _i("Length."),
            "attendees": {"type": "array", "items": _s("")},
        },
        ["title", "date", "start_time"],
    ),
    _schema(
        "delete_event", "Delete a calendar event.", {"event_id": _s("Event id.")}, ["event_id"]
    ),
]


class World:
    """Deterministic random facts: people, ids, dates, amounts."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def name(self) -> str:
        return f"{self.rng.choice(FIRST)} {self.rng.choice(LAST)}"

    def first(self) -> str:
        return self.rng.choice(FIRST)

    def ident(self, prefix: str) -> str:
        return f"{prefix}-{self.rng.randint(1000, 99999)}"

    def date(self) -> str:
        return f"2025-{self.rng.randint(1, 12):02d}-{self.rng.randint(1, 28):02d}"

    def time(self) -> str:
        return f"{self.rng.randint(7, 19):02d}:{self.rng.choice(['00', '15', '30', '45'])}"

    def amount(self) -> float:
        return round(self.rng.uniform(1, 2500), 2)

    def product(self) -> tuple[str, float]:
        return self.rng.choice(PRODUCTS)


def _call(name: str, args: dict) -> str:
    body = f'{{"name": {json.dumps(name)}, "arguments": {json.dumps(args)}}}'
    return f"<tool_call>\n{body}\n</tool_call>"


def _episode(w: World) -> tuple[str, list[tuple[str, dict, dict]], str]:
    """One task: (user request, [(tool, arguments, response)], final reply)."""
    r = w.rng
    kind = r.randrange(6)
    if kind == 0:
        prod, price = w.product()
        cap = round(price * r.uniform(1.1, 2.0), 2)
        pid = w.ident("P")
        user = f"Can you find a {prod} under ${cap}?"
        steps = [
            (
                "search_products",
                {"query": prod, "max_price": cap},
                {
                    "results": [
                        {
                            "product_id": pid,
                            "name": prod,
                            "price": price,
                            "in_stock": r.random() < 0.8,
                        }
                    ]
                },
            )
        ]
        final = f"I found the {prod} ({pid}) for ${price}."
    elif kind == 1:
        oid, status = w.ident("ORD"), r.choice(ORDER_STATUS)
        user = f"What is the status of my order {oid}?"
        steps = [
            (
                "get_order",
                {"order_id": oid},
                {"order_id": oid, "status": status, "placed_on": w.date(), "total": w.amount()},
            )
        ]
        final = f"Your order {oid} is {status}."
    elif kind == 2:
        cid, pid, qty = w.ident("C"), w.ident("P"), r.randint(1, 5)
        prod, price = w.product()
        oid = w.ident("ORD")
        user = f"Please order {qty} {prod} for customer {cid}."
        steps = [
            (
                "search_products",
                {"query": prod},
                {"results": [{"product_id": pid, "name": prod, "price": price}]},
            ),
            (
                "place_order",
                {"customer_id": cid, "product_id": pid, "quantity": qty},
                {"order_id": oid, "status": "pending", "total": round(price * qty, 2)},
            ),
        ]
        final = f"Done: order {oid} for {qty} x {prod}, total ${round(price * qty, 2)}."
    elif kind == 3:
        a, b, amt = w.ident("ACC"), w.ident("ACC"), w.amount()
        bal = round(amt + r.uniform(-500, 3000), 2)
        user = f"Transfer ${amt} from {a} to {b} for {w.first()}'s rent."
        steps = [
            ("get_balance", {"account_id": a}, {"account_id": a, "balance": bal, "currency": "USD"})
        ]
        if bal >= amt:
            tx = w.ident("TX")
            steps.append(
                (
                    "transfer_money",
                    {"from_account": a, "to_account": b, "amount": amt},
                    {"transaction_id": tx, "status": "completed", "date": w.date()},
                )
            )
            final = f"The transfer of ${amt} is complete (transaction {tx})."
        else:
            final = f"Your balance of ${bal} is not enough to send ${amt}."
    elif kind == 4:
        day, title = w.date(), r.choice(EVENT_TITLES)
        eid, start = w.ident("EV"), w.time()
        user = f"Add a {title} on {day} at {start} with {w.name()}."
        steps = [
            (
                "list_events",
                {"date": day},
                {
                    "date": day,
                    "events": [
                        {
                            "event_id": w.ident("EV"),
                            "title": r.choice(EVENT_TITLES),
                            "start_time": w.time(),
                        }
                    ],
                },
            ),
            (
                "create_event",
                {
                    "title": title,
                    "date": day,
                    "start_time": start,
                    "duration_minutes": r.choice([15, 30, 45, 60, 90]),
                },
                {"event_id": eid, "created": True},
            ),
        ]
        final = f"I added the {title} on {day} at {start} (event {eid})."
    else:
        acc, n = w.ident("ACC"), r.randint(2, 4)
        txs = [
            {
                "transaction_id": w.ident("TX"),
                "amount": -w.amount(),
                "date": w.date(),
                "merchant": r.choice(["Grocer", "Cafe", "Airline", "Bookshop", "Pharmacy"]),
            }
            for _ in range(n)
        ]
        user = f"Show my last {n} transactions on account {acc}."
        steps = [
            (
                "list_transactions",
                {"account_id": acc, "limit": n},
                {"account_id": acc, "transactions": txs},
            )
        ]
        final = f"Here are your last {n} transactions on {acc}."
    return user, steps, final


def _dialogue(w: World) -> str:
    """A conversation in the chat layout, special tokens left out (text only)."""
    r = w.rng
    tools = r.sample(TOOLS, r.randint(2, 5))
    parts = ["system\nYou are a helpful assistant for a shop, a bank and a calendar.\n\n"]
    parts.append(TOOLS_PREAMBLE + "".join("\n" + json.dumps(t) for t in tools))
    parts.append(TOOLS_POSTAMBLE + "\n")
    for _ in range(r.randint(1, 2)):
        user, steps, final = _episode(w)
        parts.append(f"user\n{user}\n")
        parallel = r.random() < 0.3
        groups = [steps] if parallel else [[s] for s in steps]
        for group in groups:
            lead = r.choice(["", "Let me check that.\n", "Sure.\n"])
            parts.append("assistant\n" + lead + "\n".join(_call(n, a) for n, a, _ in group))
            parts.append(
                "\nuser"
                + "".join(
                    f"\n<tool_response>\n{json.dumps(o)}\n</tool_response>" for *_, o in group
                )
                + "\n"
            )
        parts.append(f"assistant\n{final}\n")
    return "".join(parts)


NOUNS = """account address afternoon agent amount answer appointment assistant bag balance bank
bill birthday book booking branch budget building calendar call card cart catalogue category
change charge city client code colleague company confirmation cost country coupon customer date
day deadline delivery deposit desk detail discount doctor document email error evening event
family fee file flight friend gift goal group guest history holiday hotel hour invoice item
journey key kitchen language letter limit list loan location manager market meeting member
message method minute money month morning name note number office offer order owner package
page partner password payment period person phone plan policy price problem product question
receipt record refund reminder report request reservation result room rule schedule school
seat service session shipment shop size statement status store street summary support table
task team ticket time tool total trip user value warehouse week weekend window year""".split()
VERBS = """accept add allow answer arrange ask book bring buy call cancel change charge check
choose close compare confirm contact cover create decide deliver describe explain find finish
follow forget give help hold include keep know leave let like look love make mean meet miss move
need offer open order pay plan prefer prepare print promise provide reach read receive remember
remove repeat reply report request reschedule return review save schedule search see send share
ship show sign spend start stay suggest take tell think transfer try update use verify wait want
withdraw write""".split()
ADJS = """available busy careful cheap clear correct daily different early easy empty expensive
fast final free full good great happy important large late local long main monthly new next
old open overdue pending personal possible private quick ready recent regular right safe same
short simple small special sure total urgent useful usual valid weekly wrong""".split()
ADVS = """again already also always carefully early exactly finally later never now often only
quickly soon still today tomorrow usually yesterday""".split()
NUMS = "two three four five six seven eight nine ten several many some few".split()
PREPS = """about after at before by during for from in into near of on over through to under
with without""".split()


CITIES = """Amsterdam Athens Barcelona Berlin Boston Brussels Cairo Chicago Dublin Denver Geneva
Hamburg Helsinki Istanbul Lisbon London Madrid Milan Montreal Munich Nairobi Oslo Paris Prague
Rome Seattle Seoul Stockholm Sydney Tokyo Toronto Vienna Warsaw Zurich""".split()


def _inflect(word: str, form: str) -> str:
    """Crude English inflection: enough to spread the corpus over word forms."""
    if form == "s":
        return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    stem = word[:-1] if word.endswith("e") else word
    return stem + ("ed" if form == "ed" else "ing")


def _plain(w: World) -> str:
    """A grammatical-looking English sentence from a word bank (vocabulary breadth)."""
    r = w.rng
    subj = r.choice(
        [
            "I",
            "We",
            "You",
            "They",
            "The customer",
            "The manager",
            w.first(),
            f"The {r.choice(NOUNS)}",
            "My friend",
            "Our team",
            "She",
            "He",
        ]
    )
    verb = r.choice(VERBS)
    obj = f"the {r.choice(ADJS)} {r.choice(NOUNS)}"
    tail = f"{r.choice(PREPS)} the {r.choice(NOUNS)}"
    forms = [
        f"{subj} will {verb} {obj} {tail}.",
        f"{subj} can {verb} {obj} {r.choice(ADVS)}.",
        f"Did {subj.lower() if subj in ('We', 'You', 'They', 'She', 'He') else subj} {verb} {obj}?",
        f"Please {verb} {obj} {tail} {r.choice(ADVS)}.",
        f"{subj} wanted to {verb} {obj}, but the {r.choice(NOUNS)} was {r.choice(ADJS)}.",
        f"It is {r.choice(ADJS)} to {verb} {obj} {tail}.",
        f"{subj} {_inflect(verb, 'ed')} {r.choice(NUMS)} {_inflect(r.choice(NOUNS), 's')} "
        f"{tail} in {r.choice(CITIES)}.",
        f"{subj} is {_inflect(verb, 'ing')} the {_inflect(r.choice(NOUNS), 's')} {r.choice(ADVS)}.",
        f"{r.choice(CITIES)} {_inflect(r.choice(NOUNS), 's')} {_inflect(verb, 's')} "
        f"{r.choice(ADJS)} {_inflect(r.choice(NOUNS), 's')}.",
    ]
    return r.choice(forms)


def _sentence(w: World) -> str:
    r = w.rng
    prod, price = w.product()
    templates = [
        f"{w.name()} bought a {prod} for ${price} on {w.date()}.",
        f"The meeting with {w.name()} starts at {w.time()} and lasts {r.randint(1, 3)} hours.",
        f"Account {w.ident('ACC')} received a payment of ${w.amount()} yesterday.",
        f"Please confirm the {r.choice(EVENT_TITLES)} on {w.date()}.",
        f"Order {w.ident('ORD')} was {r.choice(ORDER_STATUS)} and the customer was notified.",
        f"I could not find that item, but the {prod} is in stock.",
        f"Your balance is ${w.amount()} after the transfer to {w.first()}.",
        "Thank you! Is there anything else I can help you with today?",
        f"Sorry, the {r.choice(CATEGORIES)} section has no results for that query.",
        f"{w.first()} asked to move the {r.choice(EVENT_TITLES)} to next {r.choice(WEEKDAYS)}.",
    ]
    return r.choice(templates)


DEMO_DIALOGUES = Path(__file__).with_name("demo_tokenizer_dialogues.json.gz")


def _demo_dialogues(n: int) -> list[str]:
    """Oracle conversations of the demo domain's tasks (a split no run trains or evaluates
    on), in the same text layout as `_dialogue`: the demo policy's prompts and trajectories
    then cost ~25% fewer tokens, and an id is a token or two wherever it appears.

    They are read from a frozen snapshot (`DEMO_DIALOGUES`, 2,000 conversations of the domain
    as it was when the tokenizer was made, customers still named), not generated from the
    live domain: a change to the domain must not change the vocabulary, or every trained
    policy, the shipped demo base included, would read different ids."""
    with gzip.open(DEMO_DIALOGUES, "rt", encoding="utf-8") as f:
        docs = json.load(f)
    if len(docs) < n:
        raise ValueError(f"{DEMO_DIALOGUES.name}: {len(docs)} conversations, need {n}")
    return docs[:n]


def make_corpus(seed: int = SEED) -> list[str]:
    """The deterministic training corpus (a list of documents)."""
    w = World(random.Random(seed))
    docs = [_dialogue(w) for _ in range(NUM_DIALOGUES)]
    docs += [_sentence(w) for _ in range(NUM_SENTENCES)]
    docs += [_plain(w) for _ in range(NUM_PLAIN)]
    docs += _demo_dialogues(NUM_DEMO_DIALOGUES)
    return docs


# ---------------------------------------------------------------------------------------------


def build_tokenizer(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r" (?=[\p{L}\p{N}])"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=s, normalized=False, single_word=False, lstrip=False, rstrip=False)
        for t, s in SPECIAL_TOKENS
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # The trainer marks every token it is given as special; restore Qwen3's flags (the tool and
    # think tags stay single ids but are ordinary added tokens).
    spec = json.loads(tok.to_str())
    flags = dict(SPECIAL_TOKENS)
    for entry in spec["added_tokens"]:
        entry["special"] = flags[entry["content"]]
    return Tokenizer.from_str(json.dumps(spec))


def tokenizer_config() -> dict:
    return {
        "backend": "tokenizers",
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(make_corpus())
    files = {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n",
        "chat_template.jinja": CHAT_TEMPLATE,
    }
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8", newline="\n")
        paths.append(path)
    return paths


def main() -> None:
    default = Path(__file__).resolve().parents[1] / "envace_jax" / "text" / "demo_tokenizer"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default, help="output directory")
    args = parser.parse_args()
    for path in write(args.out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

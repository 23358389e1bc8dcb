"""Regenerate the quickstart assets: ``corpus.txt``, ``train.jsonl`` and ``eval.jsonl``.

Everything here is generated from a fixed seed with the standard library only, so running
``python recipes/quickstart/make_data.py`` reproduces the shipped files byte for byte
(``tests/test_quickstart_assets.py`` checks that). They live in the package,
``nxd_finetune/assets/quickstart/``, so an installed nxd-finetune has them.

The task: tell whether a number is even or odd. The answer is one token (``even`` / ``odd``) and
depends only on the number's last digit (the quickstart tokenizer splits digits individually), so a
tiny randomly initialised model trained with LoRA for a minute on CPU can learn it: first the answer
format (accuracy ~50%), then the rule (accuracy towards 100%). Eval numbers never occur in train.
About a fifth of the conversations have two question/answer turns and some have a system message,
which exercises multi-turn loss masking.

``corpus.txt`` is plain English made from a small grammar (not copied from anywhere); it only
serves to train the quickstart's byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "nxd_finetune" / "assets" / "quickstart"
SEED = 1234
N_TRAIN = 512
N_EVAL = 80

QUESTION_TEMPLATES = (
    "Is {n} even or odd?",
    "Is the number {n} odd or even?",
    "{n}: even or odd?",
    "Tell me if {n} is even or odd.",
)
SYSTEM_PROMPTS = (
    "Answer with one word.",
    "You are a helpful assistant. Reply with even or odd.",
)

ADJECTIVES = """
small large quiet bright old young green red blue yellow happy tired busy careful gentle strong warm
cold clever simple round heavy light early late kind brave curious calm tall short new ancient
modern narrow wide deep shallow sharp soft hard smooth rough clean dirty empty full fresh stale
proud humble eager lazy patient honest polite rude quick slow loud silent golden silver wooden
stone paper cotton woolen sunny rainy windy snowy foggy stormy cloudy hungry thirsty sleepy lucky
famous strange ordinary special secret hidden open closed broken perfect tiny huge distant nearby
northern southern eastern western friendly lonely cheerful serious funny noisy peaceful colorful
purple orange brown white black pink grey crimson thin thick sweet bitter salty sour spicy
""".split()
NOUNS = """
cat dog teacher farmer river garden window child baker train bird student doctor city village
friend horse boat book letter apple banana mountain forest road table lamp song story cloud
painter engineer robot computer number question answer market school island bridge castle tower
harbor valley desert ocean lake meadow field orchard kitchen library museum station airport
bakery factory hospital theater temple palace cottage cabin tent ladder bucket basket blanket
pillow candle mirror clock compass map lantern kettle teapot spoon fork knife plate bowl bottle
jar cup hammer needle thread button ribbon scarf glove boot hat coat shirt jacket umbrella wallet
key lock door gate fence wall roof chimney stair floor carpet curtain shelf drawer cupboard desk
chair bench sofa bed pencil brush canvas drum guitar violin piano flute trumpet bell whistle
kite balloon puzzle ball wheel engine wagon bicycle ship rocket planet star moon comet sun sky
rain snow storm thunder wind breeze fog frost ice flame smoke ash sand pebble rock crystal
diamond pearl coin treasure crown sword shield arrow bow flag feather leaf branch root seed
flower rose tulip daisy lily oak pine maple willow grass moss mushroom berry cherry grape lemon
orange melon peach pear plum carrot potato tomato onion pepper bean pea corn wheat rice bread
cheese butter honey sugar salt soup pie cake cookie muffin sandwich tea coffee milk juice water
fox wolf bear rabbit squirrel mouse owl eagle hawk sparrow robin crow duck goose swan frog
turtle snake lizard fish whale dolphin shark octopus crab shrimp bee ant butterfly spider beetle
cow sheep goat pig chicken donkey camel elephant lion tiger zebra giraffe monkey panda kangaroo
king queen prince princess knight wizard pilot sailor soldier guard nurse chef waiter tailor
merchant miner hunter fisher gardener poet singer dancer actor writer reader scientist
inventor explorer traveler neighbor stranger visitor grandmother grandfather uncle aunt cousin
brother sister mother father baby
""".split()
VERBS = """
see like find follow carry paint read build visit help watch count open close remember answer
write move check bring catch choose clean climb cook cross draw drink drive eat fill fix fold
gather greet guide hide hold hug join jump keep kick knock laugh lift listen look love mend
miss need offer order pack pass plant play pour pull push reach repair rest return ride ring
save search sell send shake share show sing sit sleep smell solve sort start stop study swim
taste teach thank throw touch trust try turn wait walk want wash wear whisper wish wonder work
""".split()
ADVERBS = """
slowly quickly quietly loudly happily sadly carefully gently proudly eagerly patiently bravely
calmly softly warmly kindly often rarely always never sometimes usually today tomorrow yesterday
""".split()
NAMES = """
Anna Ben Clara David Emma Felix Grace Henry Iris Jack Kate Leo Mia Noah Olivia Peter Quinn Rosa
Sam Tara Umar Vera Will Xena Yusuf Zoe
""".split()
PLACES = (
    "in the morning",
    "near the river",
    "at the market",
    "after lunch",
    "before dinner",
    "in the garden",
    "on the hill",
    "at school",
    "by the window",
    "under the old tree",
    "every day",
    "in the evening",
    "during the storm",
    "on the train",
)
CONNECTIVES = ("Then", "Later", "Meanwhile", "After that", "Suddenly", "Of course", "Still")
NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
)


def parity(n: int) -> str:
    return "even" if n % 2 == 0 else "odd"


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "x", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _past(verb: str) -> str:
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"  # regular forms only: "catched" is an accepted oddity of this toy grammar


def _gerund(verb: str) -> str:
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


def _story_sentence(rng: random.Random) -> str:
    a1, a2 = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
    n1, n2 = rng.choice(NOUNS), rng.choice(NOUNS)
    verb, place = rng.choice(VERBS), rng.choice(PLACES)
    name, adverb = rng.choice(NAMES), rng.choice(ADVERBS)
    form = rng.randrange(7)
    if form == 0:
        return f"The {a1} {n1} {_third_person(verb)} the {a2} {n2} {place}."
    if form == 1:
        return f"{rng.choice(CONNECTIVES)}, {_a(a1)} {n1} {_past(verb)} {_a(n2)}."
    if form == 2:
        return f"Does the {n1} know why the {n2} is so {a2}? Nobody can say."
    if form == 3:
        return f"{_a(n1).capitalize()} and {_a(n2)} were {a1} {place}, and they were {a2} too."
    if form == 4:
        return f"{name} was {_gerund(verb)} the {_plural(n1)} {adverb} {place}."
    if form == 5:
        return f"Many {a1} {_plural(n1)} {verb} {_plural(n2)}, but {name} {adverb} {_past(verb)} one."
    return f'{name} said: "I will {verb} the {a1} {n1} {adverb}."'


def _number_sentence(rng: random.Random) -> str:
    n = rng.randrange(10000)
    form = rng.randrange(5)
    if form == 0:
        return f"The number {n} is {parity(n)}."
    if form == 1:
        return f"{n} is an {parity(n)} number because its last digit is {n % 10}."
    if form == 2:
        k = rng.randrange(len(NUMBER_WORDS))
        return f"{NUMBER_WORDS[k].capitalize()} is {parity(k)}, and {n} is {parity(n)}."
    if form == 3:
        return f"Is {n} even or odd? The answer is\n{parity(n)}\n"
    return f"Question: {rng.choice(QUESTION_TEMPLATES).format(n=n)}\nAnswer:\n{parity(n)}\n"


def make_corpus(target_bytes: int = 200_000, seed: int = SEED) -> str:
    """About ``target_bytes`` of generated English; paragraphs mix stories and number facts."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        k = rng.randrange(3, 8)
        sentences = [_number_sentence(rng) if rng.random() < 0.35 else _story_sentence(rng) for _ in range(k)]
        paragraph = " ".join(s.strip() for s in sentences)
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


def _exchange(rng: random.Random, n: int) -> list[dict[str, str]]:
    question = rng.choice(QUESTION_TEMPLATES).format(n=n)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": parity(n)}]


def make_rows(numbers: list[int], rng: random.Random, filler: list[int]) -> list[dict]:
    """One conversation per number (its last assistant turn is the graded answer).

    ``filler`` supplies the numbers of the optional earlier turn, drawn from the same split.
    """
    rows = []
    for n in numbers:
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.2:
            messages += _exchange(rng, rng.choice(filler))
        messages += _exchange(rng, n)
        rows.append({"messages": messages})
    return rows


def make_splits(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """Train and eval conversations over disjoint numbers in [0, 10000), even and odd balanced."""
    rng = random.Random(seed)
    numbers = rng.sample(range(10000), N_TRAIN + N_EVAL)
    train_numbers, eval_numbers = numbers[:N_TRAIN], numbers[N_TRAIN:]
    train = make_rows(train_numbers, rng, train_numbers)
    eval_ = make_rows(eval_numbers, rng, eval_numbers)
    return train, eval_


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def render_all() -> dict[str, str]:
    """File name -> exact content of every generated asset."""
    train, eval_ = make_splits()
    return {"corpus.txt": make_corpus(), "train.jsonl": jsonl(train), "eval.jsonl": jsonl(eval_)}


def write(files: dict[str, str]) -> None:
    """Write generated files (name -> content) into the package's quickstart assets."""
    for name, text in files.items():
        (OUT / name).write_text(text, encoding="utf-8")
        print(f"wrote {OUT / name} ({len(text.encode())} bytes)")


if __name__ == "__main__":
    write(render_all())

"""Write ``data/distill_prompts_large.jsonl``: the 90 hand-written distillation prompts followed by
templated ones (deterministic, seed 0).

The 90 hand-written prompts of ``data/distill_prompts.jsonl`` cover six task types with few topics; a
draft distilled on them alone fits those topics (alpha 0.47 at T = 0.2 on fresh samples of the training
prompts, 0.27 on the held-out ``data/prompts.jsonl``). This file adds breadth: task templates x topics
over chat, explanation, stories, code, math, summarisation, translation, question answering and
answering from a given context. The held-out prompts are never used (checked below: no shared text).

    python3 scripts/make_distill_prompts.py            # rewrites data/distill_prompts_large.jsonl
    python3 scripts/make_distill_prompts.py --per-category 200 --out /tmp/distill_prompts_xl.jsonl   # broader set
"""

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PER_CATEGORY = 70  # at most; translation and context have fewer distinct combinations

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "inflation", "vaccines", "plate tectonics", "the printing press",
    "machine learning", "compound interest", "the immune system", "climate change", "the Roman Empire", "electric cars",
    "sleep", "volcanoes", "the internet", "honeybees", "the French Revolution", "renewable energy", "DNA", "gravity",
    "the stock market", "coral reefs", "antibiotics", "the moon landing", "recycling", "earthquakes", "democracy",
    "coffee", "the human heart", "solar panels", "bread baking", "chess", "rainforests", "jazz music", "glaciers",
    "supply and demand", "the Silk Road", "quantum computers", "meditation", "tides", "bicycles", "the Olympic Games",
    "memory", "rainbows", "money", "the periodic table", "migration of birds", "public libraries", "ocean currents",
]
EXPLAIN = ["Explain {t} to a high-school student.", "What is {t}, and why does it matter?", "Give me three surprising facts about {t}.",
           "How would you explain {t} to a ten-year-old?", "What are the main causes and effects of {t}?",
           "Describe the history of {t} in a few sentences.", "What are common misconceptions about {t}?"]
CHAT = ["I'm feeling {e} about {s}. Any advice?", "Can you suggest a fun way to spend a {d} with {p}?",
        "What should I keep in mind when {s}?", "Help me write a friendly message to {p} about {s}.",
        "I have a free {d}. What could I learn about {t}?", "Can you recommend a hobby for someone who likes {t}?"]
EMOTIONS = ["nervous", "excited", "stressed", "unsure", "overwhelmed", "curious", "bored", "hopeful"]
SITUATIONS = ["starting a new job", "moving abroad", "learning to cook", "running my first race", "public speaking",
              "adopting a dog", "going back to school", "planning a wedding", "working from home", "learning to drive",
              "buying a used car", "hosting a dinner party"]
DAYS = ["rainy afternoon", "weekend", "summer evening", "long train ride", "snowy day"]
PEOPLE = ["my grandmother", "a coworker", "my best friend", "my neighbour", "my teenage son", "an old classmate"]
STORIES = ["Write a short story about {c} who {v}.", "Write a poem about {t}.", "Write a fable about {c} and {t}.",
           "Tell a bedtime story in which {c} {v}.", "Write the opening paragraph of a mystery novel involving {t}."]
CHARACTERS = ["a lonely robot", "a young wizard", "an old fisherman", "a curious cat", "a time traveller", "a shy dragon",
              "a detective", "a lighthouse keeper", "a street musician", "an astronaut"]
VERBS = ["finds a hidden door", "loses their voice", "meets a talking tree", "builds a boat", "forgets their own name",
         "wins a strange contest", "discovers a new colour", "befriends a ghost"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "counts the words in a text", "splits a sentence into words",
              "merges two sorted lists", "computes the median of a list", "computes the n-th triangular number",
              "removes duplicates from a list while keeping order", "converts Celsius to Fahrenheit",
              "returns the n-th Fibonacci number", "flattens a nested list",
              "counts how often each character occurs", "validates an email address with a regular expression",
              "reads a CSV file and prints the average of a column", "sorts a list of dictionaries by a key",
              "computes the greatest common divisor of two integers", "transposes a matrix"]
CODE = ["Write a Python function that {k}.", "Write a JavaScript function that {k}, with a short explanation.",
        "How would you write a function that {k}? Explain the time complexity.", "Write a unit test for a function that {k}."]
TRANSLATE_TO = ["French", "Spanish", "German", "Italian", "Portuguese"]
SENTENCES = ["The weather is lovely today.", "Where is the nearest train station?", "I would like a cup of tea, please.",
             "My brother is learning to play the guitar.", "We are going to the beach tomorrow.",
             "This book is more interesting than the film.", "Could you help me carry these boxes?",
             "The museum opens at nine in the morning.", "I forgot my umbrella at home.", "She has lived here for ten years.",
             "How much does this jacket cost?", "The children are playing in the garden."]
FACTS = {
    "the Eiffel Tower": "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is about 330 metres tall "
                        "and was the tallest man-made structure in the world until 1930.",
    "honey": "Honey is made by bees from flower nectar. Because it has little water and is slightly acidic, it can "
             "last for a very long time without spoiling.",
    "the Amazon river": "The Amazon river flows through South America and carries more water than any other river. "
                        "Its basin covers about seven million square kilometres.",
    "octopuses": "Octopuses have three hearts and blue blood. They can change the colour and texture of their skin "
                 "to hide from predators.",
    "the Great Wall": "The Great Wall of China was built over many centuries by different dynasties. Its sections "
                      "together stretch for thousands of kilometres.",
    "tea": "Tea is made by soaking the leaves of the tea plant in hot water. Green and black tea come from the same "
           "plant but are processed differently.",
}
CONTEXT = ["Read the text and answer the question.\n\nText: {f}\n\nQuestion: {q}",
           "Using only the passage below, answer: {q}\n\nPassage: {f}",
           "Summarise the following text in one sentence:\n\n{f}", "Give a short title for this paragraph:\n\n{f}"]
QUESTIONS = ["What is the main point of the text?", "What number is mentioned, and what does it refer to?",
             "Why is this interesting?", "What would be a good follow-up question?"]


def math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 12)
    return rng.choice([
        f"A shop sells {a} apples for {b} dollars. How much do {c} apples cost? Show your steps.",
        f"What is {a} times {b}, minus {c}? Explain your working.",
        f"Solve for x: {c}x + {a} = {a + c * b}.",
        f"A train travels {a * 10} km in {c} hours. What is its average speed?",
        f"If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?",
        f"Tom has {a} marbles and gives away {min(a - 1, c)}. Then he buys {b} more. How many does he have now?",
        f"What is {c * 5} percent of {a * 20}?",
    ])


def build(rng: random.Random, per_category: int = PER_CATEGORY) -> list[dict]:
    makers = {
        "explanation": lambda: rng.choice(EXPLAIN).format(t=rng.choice(TOPICS)),
        "chat": lambda: rng.choice(CHAT).format(e=rng.choice(EMOTIONS), s=rng.choice(SITUATIONS), d=rng.choice(DAYS),
                                                 p=rng.choice(PEOPLE), t=rng.choice(TOPICS)),
        "stories": lambda: rng.choice(STORIES).format(c=rng.choice(CHARACTERS), v=rng.choice(VERBS), t=rng.choice(TOPICS)),
        "code": lambda: rng.choice(CODE).format(k=rng.choice(CODE_TASKS)),
        "math": lambda: math_prompt(rng),
        "translation": lambda: f"Translate into {rng.choice(TRANSLATE_TO)}: \"{rng.choice(SENTENCES)}\"",
        "question_answering": lambda: rng.choice(["Who invented {t}?", "When did people first study {t}?",
                                                  "Where can I see {t} in everyday life?", "Is {t} dangerous? Why or why not?"]
                                                 ).format(t=rng.choice(TOPICS)),
        "context": lambda: rng.choice(CONTEXT).format(f=FACTS[rng.choice(sorted(FACTS))], q=rng.choice(QUESTIONS)),
    }
    rows = []
    for category, make in makers.items():
        seen = set()
        for _ in range(50 * per_category):  # some categories have fewer distinct prompts than per_category
            if len(seen) == per_category:
                break
            text = make()
            if text not in seen:
                seen.add(text)
                rows.append({"id": f"large-{category}-{len(seen):03d}", "category": category, "turns": [text]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=PER_CATEGORY, help="templated prompts per category, at most")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "distill_prompts_large.jsonl")
    args = parser.parse_args()
    handwritten = [json.loads(line) for line in (ROOT / "data" / "distill_prompts.jsonl").read_text().splitlines() if line.strip()]
    rows = handwritten + build(random.Random(0), args.per_category)
    heldout = {t for line in (ROOT / "data" / "prompts.jsonl").read_text().splitlines() if line.strip()
               for t in json.loads(line)["turns"]}
    assert not heldout & {r["turns"][0] for r in rows}, "a templated prompt equals a held-out prompt"
    out = args.out
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {out}")


if __name__ == "__main__":
    main()

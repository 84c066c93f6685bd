"""Few-shot question answering over a batch: the constant few-shot prefix is traced and
cached once, then every question reuses its KV (radix cache)."""

import radixlm as sgl

EXAMPLES = (
    "Answer each question with a short phrase.\n"
    "Q: What is the capital of Italy?\nA: Rome\n"
    "Q: How many legs does a spider have?\nA: Eight\n"
    "Q: What gas do plants breathe in?\nA: Carbon dioxide\n"
)
QUESTIONS = [
    "What is the capital of Japan?",
    "How many days are in a week?",
    "What is the largest planet?",
    "What color is a ripe banana?",
]


@sgl.function
def few_shot_qa(s, question):
    s += EXAMPLES + "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=8, stop="\n")


def main(questions=QUESTIONS):
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0, progress_bar=True)
    for q, st in zip(questions, states):
        print(f"{q} -> {st['answer'].strip()}")
    return states


if __name__ == "__main__":
    sgl.set_default_backend(sgl.get_default_backend() or sgl.Runtime())
    main()

"""Quick start: a two-turn chat program on the default model (SmolLM2-135M, CPU).

    python examples/quickstart.py          # or: radixlm run examples/quickstart.py

Shows gen, select, roles and reading variables; runs in well under a minute on a laptop CPU."""

import radixlm as sgl


@sgl.function
def quick_chat(s, question):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24))
    with s.user():
        s += "Was that answer about science or art? Reply with one word."
    with s.assistant():
        s += sgl.select("topic", choices=["science", "art"])


def main():
    state = quick_chat.run("Why is the sky blue?", temperature=0)
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")
    print(
        "topic:",
        state["topic"],
        "| mean logprobs:",
        [round(x, 2) for x in state.get_meta_info("topic")["normalized_prompt_logprobs"]],
    )
    return state


if __name__ == "__main__":
    sgl.set_default_backend(sgl.get_default_backend() or sgl.Runtime())
    main()

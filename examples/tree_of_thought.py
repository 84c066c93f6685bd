"""Tree of thought with fork: propose several first steps in parallel (the shared prefix is
prefilled once and pinned), let the model judge each with `select`, expand the best one.
Each branch starts from a different approach hint, so the tree is deterministic at temperature 0."""

import radixlm as sgl

APPROACHES = ["write an equation", "count directly", "reason in words", "draw a picture"]


@sgl.function
def tree_of_thought(s, problem, width=3):
    s += sgl.user(f"Solve step by step: {problem}")
    s += sgl.assistant_begin()
    branches = s.fork(width)
    branches += lambda i: f"Step 1 ({APPROACHES[i % len(APPROACHES)]}):"
    branches += sgl.gen("step", max_tokens=16, stop="\n")
    for b in branches:
        b += "\nIs this step correct? Answer yes or no: "
        b += sgl.select("verdict", choices=["yes", "no"])
    branches.join()
    scores = [
        meta["normalized_prompt_logprobs"][0]  # logprob of "yes"
        for meta in s.get_meta_info("verdict")
    ]
    best = max(range(width), key=scores.__getitem__)
    s += (
        f"Step 1 ({APPROACHES[best % len(APPROACHES)]}):"
        + s["step"][best]
        + "\nStep 2:"
        + sgl.gen("step2", max_tokens=16, stop="\n")
    )
    s += sgl.assistant_end()
    return best


def main(problem="A farmer has 12 sheep and buys 5 more. How many sheep does he have?"):
    st = tree_of_thought.run(problem, temperature=0)
    for i, (step, verdict) in enumerate(zip(st["step"], st["verdict"])):
        print(f"branch {i}: {step.strip()!r} -> {verdict}")
    print("chosen:", st.ret_value, "| step 2:", st["step2"].strip())
    return st


if __name__ == "__main__":
    sgl.set_default_backend(sgl.get_default_backend() or sgl.Runtime())
    main()

"""A tool-calling ReAct agent: the model picks an action with `select`, writes the tool's
argument with `gen(stop=")")`, Python runs the tool and appends the observation."""

import radixlm as sgl

FACTS = {
    "eiffel tower": "The Eiffel Tower is in Paris and is 330 metres tall.",
    "mount everest": "Mount Everest is 8849 metres high, on the Nepal-China border.",
    "python": "Python is a programming language created by Guido van Rossum in 1991.",
}


def search(query: str) -> str:
    q = query.lower().strip(" \"'")
    for key, fact in FACTS.items():
        if key in q or q in key:
            return fact
    return "No result."


PROMPT = """Answer the question using the Search tool. Format:
Thought: <reasoning>
Action: Search(<query>) or Finish(<answer>)
Observation: <tool result>

Question: How tall is the Eiffel Tower?
Thought: I should look up the Eiffel Tower.
Action: Search(eiffel tower)
Observation: The Eiffel Tower is in Paris and is 330 metres tall.
Thought: I know the answer.
Action: Finish(330 metres)

"""


@sgl.function
def react_agent(s, question, max_steps=3):
    s += PROMPT + "Question: " + question + "\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=16, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action_{step}", choices=["Search", "Finish"]) + "("
        s += sgl.gen(f"arg_{step}", max_tokens=12, stop=")") + ")\n"
        if s[f"action_{step}"] == "Finish":
            return s[f"arg_{step}"]
        s += "Observation: " + search(s[f"arg_{step}"]) + "\n"
    return None


def main(questions=("How high is Mount Everest?", "Who created Python?")):
    states = react_agent.run_batch([{"question": q} for q in questions], temperature=0)
    for q, st in zip(questions, states):
        print(st.text()[len(PROMPT) :])
        print(f"==> {q} answer: {st.ret_value!r}\n")
    return states


if __name__ == "__main__":
    sgl.set_default_backend(sgl.get_default_backend() or sgl.Runtime())
    main()

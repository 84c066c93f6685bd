"""Parallel summarisation: fork once per paragraph, summarise all paragraphs concurrently,
join the partial summaries back into the main state, then write an overall summary."""

import radixlm as sgl

DOCUMENT = [
    "The printing press, invented by Johannes Gutenberg around 1440, made books cheap. "
    "Ideas spread faster across Europe than ever before.",
    "The steam engine powered factories and trains in the 1800s. Cities grew quickly as "
    "people moved to work in the new industries.",
    "The internet connected computers worldwide in the late 20th century. Information became "
    "available to billions of people almost instantly.",
]


@sgl.function
def summarise(s, paragraphs):
    s += "Summarise each paragraph in one short sentence.\n\n"
    parts = s.fork(len(paragraphs))
    parts += [f"Paragraph: {p}\nOne-sentence summary:" for p in paragraphs]
    parts += sgl.gen("summary", max_tokens=24, stop="\n")
    parts.join()
    for i, summary in enumerate(s["summary"]):
        s += f"{i + 1}.{summary}\n"
    s += "Overall, these paragraphs are about" + sgl.gen("overall", max_tokens=16, stop="\n")


def main(paragraphs=DOCUMENT):
    st = summarise.run(paragraphs, temperature=0)
    print(st.text())
    return st


if __name__ == "__main__":
    sgl.set_default_backend(sgl.get_default_backend() or sgl.Runtime())
    main()

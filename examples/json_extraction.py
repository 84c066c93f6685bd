"""Typed extraction: `gen(json_schema=PydanticClass)` decodes under the class's JSON schema
and leaves a validated instance in the state."""

from pydantic import BaseModel, Field

import radixlm as sgl


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=130)
    city: str = Field(max_length=16)


TEXTS = [
    "Maria is a 34 year old nurse who lives in Lisbon.",
    "Kenji, aged 27, works as an engineer in Osaka.",
]


@sgl.function
def extract_person(s, text):
    s += sgl.user(f"Extract the person as JSON with name, age and city.\n\n{text}")
    s += sgl.assistant(sgl.gen("person", json_schema=Person, max_tokens=48))


def main(texts=TEXTS):
    states = extract_person.run_batch([{"text": t} for t in texts], temperature=0)
    for t, st in zip(texts, states):
        person: Person = st["person"]
        print(f"{t}\n  -> {person!r}")
    return states


if __name__ == "__main__":
    sgl.set_default_backend(sgl.get_default_backend() or sgl.Runtime())
    main()

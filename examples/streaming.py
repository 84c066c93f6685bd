"""Streaming: print a program's text as it is generated, then the same with asyncio."""

import asyncio

import radixlm as sgl


@sgl.function
def haiku(s, topic):
    s += sgl.user(f"Write a haiku about {topic}.")
    s += sgl.assistant(sgl.gen("poem", max_tokens=32))


def main(topic="the sea"):
    state = haiku.run(topic, stream=True, temperature=0)
    for chunk in state.text_iter("poem"):
        print(chunk, end="", flush=True)
    print()

    async def stream_async():
        st = haiku.run("mountains", stream=True, temperature=0)
        async for chunk in st.text_async_iter("poem"):
            print(chunk, end="", flush=True)
        print()
        return st

    return state, asyncio.run(stream_async())


if __name__ == "__main__":
    sgl.set_default_backend(sgl.get_default_backend() or sgl.Runtime())
    main()

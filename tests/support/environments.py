"""An interactive environment the tests load into the reward sandbox (written beside them as a module)."""

ARE_YOU_SURE = '''
class AreYouSure:
    """Two turns: the model answers, is asked again, and is paid for its second answer."""

    def __init__(self, question: str = "Are you sure?"):
        self.question = question

    def reset(self, row):
        self.answer = row["answer"]
        prompt = row["prompt"]
        return [{"role": "user", "content": prompt if isinstance(prompt, str) else prompt[-1]["content"]}]

    def step(self, messages):
        asked = sum(m["role"] == "user" for m in messages)
        if asked == 1:
            return {"messages": [{"role": "user", "content": self.question}], "done": False}
        return {"messages": [], "reward": float(messages[-1]["content"] == self.answer), "done": True}
'''

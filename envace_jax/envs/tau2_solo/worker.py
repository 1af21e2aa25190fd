"""The tau2-bench side of the `tau2_mock` and `tau2_telecom` domains: a process in the venv of
`make tau2` that loads a domain's solo-mode tasks, executes calls in its environments and scores
episodes with its own evaluator. It imports only the standard library and `tau2`;
`envs/worker_loop.py` serves its `answer`, one JSON request per line:

    {"op": "load", "domain": D}               -> every task tau2's solo agent can run (a
                                                 ticket and expected actions): id, ticket, the
                                                 solo policy, the tools (the agent's and, in
                                                 solo mode, the user's), the expected actions
                                                 and what the environment answers them, the
                                                 package's split, and the evaluator's reward
                                                 for that gold episode
    {"op": "reset", "env": E, "id": I}        -> world E set to task I's initial state
    {"op": "step", "env": E, "calls": [...]}  -> {content, error} per {name, arguments}
    {"op": "check", "env": E}                 -> the evaluator's reward for world E's episode,
                                                 ended by the solo agent's stop (0 when the
                                                 evaluator raises on it)
    {"op": "close", "env": E}                 -> world E forgotten

A world is what tau2's orchestrator builds for `llm_agent_solo`: the domain's environment in
solo mode, its state set from the task's initial state. Calls go through its `get_response`
as the assistant's, so user-device tools run on the user's side as in a solo run, and the
episode (assistant tool calls, tool messages) is recorded as tau2's own messages. `check`
scores that record with `evaluate_simulation` (evaluation type ALL, solo mode), as `tau2 run`
does.
"""

import uuid

from tau2.agent.llm_agent import LLMSoloAgent
from tau2.data_model.message import AssistantMessage, ToolCall
from tau2.data_model.simulation import SimulationRun, TerminationReason
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
from tau2.registry import registry

TASKS = {}  # (domain, id) -> tau2 Task
WORLDS = {}  # env id -> [domain, task, environment, messages]


def new_world(domain, task):
    env = registry.get_env_constructor(domain)(solo_mode=True)
    state = task.initial_state
    history = list(state.message_history or []) if state else []
    env.set_state(
        initialization_data=state.initialization_data if state else None,
        initialization_actions=state.initialization_actions if state else None,
        message_history=history,
    )
    return [domain, task, env, history]


def execute(world, calls):
    env, messages = world[2], world[3]
    tool_calls = [
        ToolCall(id=f"call_{len(messages)}_{i}", name=c["name"], arguments=c["arguments"])
        for i, c in enumerate(calls)
    ]
    messages.append(AssistantMessage(role="assistant", content=None, tool_calls=tool_calls))
    out = []
    for call in tool_calls:
        answer = env.get_response(call)
        messages.append(answer)
        out.append({"content": answer.content, "error": bool(answer.error)})
    return out


def reward(world):
    domain, task, _, messages = world
    stop = AssistantMessage(role="assistant", content=LLMSoloAgent.STOP_TOKEN)
    run = SimulationRun(
        id=str(uuid.uuid4()),
        task_id=task.id,
        start_time="",
        end_time="",
        duration=0.0,
        termination_reason=TerminationReason.AGENT_STOP,
        messages=[*messages, stop],
    )
    info = evaluate_simulation(run, task, EvaluationType.ALL, solo_mode=True, domain=domain)
    return float(info.reward)


def load(domain):
    tasks = [t for t in registry.get_tasks_loader(domain)() if LLMSoloAgent.check_valid_task(t)]
    split_of = {}
    loader = registry.get_task_splits_loader(domain)  # None for a domain without splits
    splits = (loader() if loader else None) or {}
    for name in ("train", "test"):
        split_of.update({i: name for i in splits.get(name, [])})
    env = registry.get_env_constructor(domain)(solo_mode=True)
    tools = env.get_tools() + (env.get_user_tools() if env.user_tools else [])
    schemas = [t.openai_schema for t in tools]
    out = []
    for task in tasks:
        TASKS[domain, task.id] = task
        world = new_world(domain, task)
        actions = [
            {"name": a.name, "arguments": dict(a.arguments)}
            for a in task.evaluation_criteria.actions
        ]
        responses = [execute(world, [a])[0] for a in actions]
        out.append(
            {
                "id": task.id,
                "ticket": task.ticket,
                "policy": env.get_policy(),
                "tools": schemas,
                "actions": actions,
                "responses": responses,
                "split": split_of.get(task.id),
                "gold_reward": reward(world),
            }
        )
    return out


def answer(req):
    op = req["op"]
    if op == "load":
        return load(req["domain"])
    if op == "reset":
        domain, task_id = req["id"].split("/", 1)
        WORLDS[req["env"]] = new_world(domain, TASKS[domain, task_id])
        return None
    if op == "step":
        return execute(WORLDS[req["env"]], req["calls"])
    if op == "check":
        try:
            return {"reward": reward(WORLDS[req["env"]])}
        except Exception as exc:  # tau2's evaluator raises on some failed episodes (an env
            # assertion about a record the agent never made): the episode failed
            return {"reward": 0.0, "evaluator_error": f"{type(exc).__name__}: {exc}"}
    if op == "close":
        WORLDS.pop(req["env"], None)
        return None
    raise ValueError(f"unknown op {op!r}")

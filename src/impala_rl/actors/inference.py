"""Central inference (``runner.inference=central``): actors step envs, the learner process acts.

Each actor process owns a row of every request and response field below (shared tensors
``[num_actors, M, ...]``, ``M = envs_per_actor * n_agents``: the most decisions one call
carries) and one pipe to the :class:`InferenceServer`, a thread of the learner process. An
actor's :class:`CentralActing` writes a group's observations (and its first flags, core state
and last inputs when the model reads them) into its rows, sends ``(kind, step_key, n)`` and
waits; the server gathers every waiting actor's request, runs the policy once per
``(kind, step key)`` on its device, samples, writes actions and log-probs (or values) back
into the rows and answers each actor with the version of the weights it used. The actor
stamps the oldest version of an unroll on its slot, so V-trace's behaviour policy and
``max_policy_lag`` refer to the weights that acted.

The LSTM state travels with each request and stays with the actor (its decision streams
carry it as with actor-side inference), so a restarted actor or server loses nothing. The
server's weights are its own copy on the device, replaced after every update; actors need
no weights.

==================  ===================  ===================================================
field               shape (per actor)    meaning
==================  ===================  ===================================================
``obs`` (``_{k}``)  ``[M, *o_k]``        the deciding agents' observations (request)
``action_mask``     ``[M, n_k]``         their legal actions (keys with a mask)
``first``           ``[M]``              an agent's first decision of an episode (a core)
``core_h/_c``       ``[M, H]``           the core state before the decision; after it, in
                                         the response
``last_inputs``     ``[M, E]``           the agents' last action and reward, encoded
``action`` (``_k``) ``[M, *a_k]``        the sampled action (response)
``log_prob``        ``[M]``              its log-probability under the server's policy
``value``           ``[M]``              a ``value`` request's answer
==================  ===================  ===================================================
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from impala_rl.nn import Acted, Model
from impala_rl.rollout import RolloutSpec, rollout_spec_for

POLL_S = 0.05


def allocate_requests(spec: RolloutSpec, num_actors: int, rows: int) -> dict[str, torch.Tensor]:
    """The shared request and response fields of ``num_actors`` actors, ``rows`` each, laid
    out as ``spec``'s step keys (one tensor per field, so a process receives a fixed number
    of file descriptors)."""
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for k, key in enumerate(spec.keys):
        fields[spec.key_field("obs", k)] = ((rows, *key.obs_shape), key.obs_dtype)
        fields[spec.key_field("action", k)] = ((rows, *key.action_shape), key.action_dtype)
        if key.mask_size is not None:
            fields[spec.key_field("action_mask", k)] = ((rows, key.mask_size), torch.bool)
    fields["first"] = ((rows,), torch.bool)
    fields["log_prob"] = ((rows,), torch.float32)
    fields["value"] = ((rows,), torch.float32)
    if spec.core_state_size:
        for name in ("core_h", "core_c"):
            fields[name] = ((rows, spec.core_state_size), torch.float32)
    if spec.last_inputs_size:
        fields["last_inputs"] = ((rows, spec.last_inputs_size), torch.float32)
    return {
        name: torch.zeros((num_actors, *shape), dtype=dtype).share_memory_()
        for name, (shape, dtype) in fields.items()
    }


class CentralActing:
    """An actor's side of central inference: the actor loop's ``acting`` (see
    :class:`impala_rl.rollout.LocalActing`). ``buffers`` are this actor's rows of
    :func:`allocate_requests`; ``model`` is used only for ``to_env`` (its weights are never
    read)."""

    def __init__(self, conn: Connection, buffers: dict[str, torch.Tensor], model: Model):
        self.conn = conn
        self.buffers = buffers
        self.model = model
        self.key_field = rollout_spec_for(model, None, 1, 1).key_field  # the slot's field names
        self._oldest: int | None = None

    def _call(self, kind: str, step_key: int, n: int) -> None:
        self.conn.send((kind, step_key, n))
        version = self.conn.recv()
        self._oldest = version if self._oldest is None else min(self._oldest, version)

    def _request(
        self,
        step_key: int,
        obs: torch.Tensor,
        action_mask: torch.Tensor | None,
        first: torch.Tensor | None,
        core_state: Any,
        extra: torch.Tensor | None,
    ) -> int:
        b, n = self.buffers, obs.shape[0]
        b[self.key_field("obs", step_key)][:n].copy_(obs)
        if action_mask is not None:
            b[self.key_field("action_mask", step_key)][:n].copy_(action_mask)
        if first is not None:
            b["first"][:n].copy_(first)
        if core_state is not None:
            b["core_h"][:n].copy_(core_state[0][0])
            b["core_c"][:n].copy_(core_state[1][0])
        if extra is not None:
            b["last_inputs"][:n].copy_(extra)
        return n

    def act(
        self,
        step_key: int,
        obs: torch.Tensor,
        action_mask: torch.Tensor | None,
        first: torch.Tensor | None,
        core_state: Any,
        extra: torch.Tensor | None,
    ) -> Acted:
        n = self._request(step_key, obs, action_mask, first, core_state, extra)
        self._call("act", step_key, n)
        b = self.buffers
        action = b[self.key_field("action", step_key)][:n].clone()
        state = None
        if core_state is not None:
            state = (b["core_h"][:n].clone().unsqueeze(0), b["core_c"][:n].clone().unsqueeze(0))
        env_action = self.model.action_head(step_key).to_env(action)
        return Acted(action, b["log_prob"][:n].clone(), env_action, state)

    def value(
        self, step_key: int, obs: torch.Tensor, extra: torch.Tensor | None, core_state: Any
    ) -> torch.Tensor:
        n = self._request(step_key, obs, None, None, core_state, extra)
        self._call("value", step_key, n)
        return self.buffers["value"][:n].clone()

    def unroll_version(self, loaded_version: int) -> int:
        """The oldest server version that acted since the last call (the unroll's)."""
        version = loaded_version if self._oldest is None else self._oldest
        self._oldest = None
        return version


class InferenceServer:
    """One thread in the learner process that acts for every actor (see the module doc).

    ``connections()`` returns the current ``{actor index: pipe}`` (actors restart with new
    pipes); a pipe that breaks is skipped, its actor's death is the backend's business.
    :meth:`load` replaces the weights between two batches of requests.
    """

    def __init__(
        self,
        model: Model,
        buffers: dict[str, torch.Tensor],
        device: torch.device | str,
        connections: Any,
        seed: int,
    ):
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device).eval()
        self.key_field = rollout_spec_for(model, None, 1, 1).key_field  # the slot's field names
        self.buffers = buffers
        self.connections = connections
        self.version = 0
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.requests_served = 0
        self.batches = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="impala-inference", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.model.load_state_dict(state_dict)
            self.version = version

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                conns = self.connections()
                if not conns:
                    self._stop.wait(POLL_S)
                    continue
                owner = {conn: index for index, conn in conns.items()}
                requests = []
                try:
                    ready = wait(list(owner), timeout=POLL_S)
                except (OSError, ValueError):
                    continue  # a pipe closed under us: an actor died, ask again
                for conn in ready:
                    try:
                        kind, step_key, n = conn.recv()
                    except (EOFError, OSError):
                        continue  # the actor is gone; the backend notices and restarts it
                    requests.append((owner[conn], conn, kind, step_key, n))
                if requests:
                    self.serve(requests)
        except BaseException as exc:  # surfaces in the backend's collect_outputs
            self._error = exc

    @torch.inference_mode()
    def serve(self, requests: list[tuple[int, Any, str, int, int]]) -> None:
        """Answer ``(actor, pipe, kind, step key, n)`` requests: one forward pass per
        ``(kind, step key)`` over all of their rows."""
        groups: dict[tuple[str, int], list[tuple[int, Any, int]]] = defaultdict(list)
        for actor, conn, kind, step_key, n in requests:
            groups[(kind, step_key)].append((actor, conn, n))
        with self._lock:
            version = self.version
            for (kind, step_key), members in groups.items():
                self._serve_group(kind, step_key, members)
        for members in groups.values():
            for _, conn, _ in members:
                try:
                    conn.send(version)
                except (BrokenPipeError, OSError):
                    pass  # died while waiting: nothing to answer
        self.requests_served += len(requests)
        self.batches += 1

    def _gather(self, name: str, members: list[tuple[int, Any, int]]) -> torch.Tensor:
        field = self.buffers[name]
        if all(n == field.shape[1] for _, _, n in members):  # whole rows: one indexed copy
            index = torch.tensor([actor for actor, _, _ in members])
            rows = field.index_select(0, index).flatten(0, 1)
        else:
            rows = torch.cat([field[actor, :n] for actor, _, n in members])
        return rows.to(self.device, non_blocking=True)

    def _scatter(self, name: str, members: list[tuple[int, Any, int]], values: Any) -> None:
        field = self.buffers[name]
        values = values.to("cpu")
        if all(n == field.shape[1] for _, _, n in members):
            index = torch.tensor([actor for actor, _, _ in members])
            field.index_copy_(0, index, values.view(len(members), *field.shape[1:]))
            return
        offset = 0
        for actor, _, n in members:
            field[actor, :n].copy_(values[offset : offset + n])
            offset += n

    def _serve_group(self, kind: str, step_key: int, members: list[tuple[int, Any, int]]) -> None:
        model, b = self.model, self.buffers
        obs = self._gather(self.key_field("obs", step_key), members)
        mask_field = self.key_field("action_mask", step_key)
        mask = self._gather(mask_field, members) if mask_field in b else None
        extra = self._gather("last_inputs", members) if model.use_last_action_reward else None
        state = None
        if model.core is not None:
            h = self._gather("core_h", members).unsqueeze(0)
            state = (h, self._gather("core_c", members).unsqueeze(0))
        if kind == "value":
            self._scatter("value", members, model.value(step_key, obs, extra, state))
            return
        first = self._gather("first", members) if model.core is not None else None
        dist, after = model.act(step_key, obs, mask, first, state, extra)
        action = dist.sample(self.generator)
        self._scatter(self.key_field("action", step_key), members, action)
        self._scatter("log_prob", members, dist.log_prob(action).float())
        if after is not None:
            self._scatter("core_h", members, after[0][0])
            self._scatter("core_c", members, after[1][0])

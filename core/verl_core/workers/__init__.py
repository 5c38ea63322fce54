"""Roles over worker groups: the actor (policy, rollout, reference) and the critic, one process per
engine rank, called through typed front ends that return materialised results.

``workers`` is the rank side (``ActorWorker``, ``CriticWorker``), ``group`` the worker groups
(in process; Ray in ``ray_group``), ``dispatch`` how batches are split by the engines' topology, and
``roles`` the trainer's view (``Actor``, ``Critic``).
"""

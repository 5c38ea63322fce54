"""Roles over worker groups: the actor (policy, rollout, reference), the critic and the SFT policy, one
process per engine rank, called through typed front ends that return materialised results.

``ranks`` is the rank side (``ActorWorker``, ``CriticWorker``, ``SFTWorker``: what one process holds and
does), ``group`` the worker groups (in process; Ray in ``ray_group``), ``dispatch`` how batches are
split by the engines' topology, and ``roles`` the trainer's view (``Actor``, ``Critic``, ``SFT``).
"""

"""Cache-aware routing across replicas: an index of what each holds
(:mod:`kvstore.route.index`, fed by KV events) and a router that picks a
replica by expected time to first token (:mod:`kvstore.route.policy`)."""
from kvstore.route.index import PrefixIndex
from kvstore.route.policy import ROUTES, Choice, Costs, NoReplicas, Router

__all__ = ["ROUTES", "Choice", "Costs", "NoReplicas", "PrefixIndex", "Router"]

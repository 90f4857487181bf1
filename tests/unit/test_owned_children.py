"""Unit tests of the ownership rule of controller.children: which live objects a job may write,
and what the conflict says. The applier's behaviour against a real API server is in
tests/e2e/test_child_ownership.py."""

from grpo_operator.controller.children import ChildConflict, conflict, owned_by, owner_of
from grpo_operator.render import names

CHILD = {"kind": "ServiceAccount", "metadata": {"name": "etl-trainer", "namespace": "ml"}}


def live(*refs: dict) -> dict:
    meta: dict = {"name": "etl-trainer", "namespace": "ml"}
    if refs:
        meta["ownerReferences"] = list(refs)
    return {"kind": "ServiceAccount", "metadata": meta}


def test_only_a_controller_reference_with_this_uid_is_ownership():
    assert owned_by(live(names.owner_reference("etl", "u-1")), "u-1")
    assert not owned_by(live(), "u-1")
    assert not owned_by(live(names.owner_reference("etl", "u-0")), "u-1"), "an earlier incarnation"
    assert not owned_by(live({**names.owner_reference("etl", "u-1"), "controller": False}), "u-1")
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "etl", "uid": "d-1", "controller": True}
    assert not owned_by(live(deploy), "u-1")


def test_conflict_names_the_object_and_its_owner():
    err = conflict(CHILD, live(), "etl")
    assert isinstance(err, RuntimeError) and err.reason == ChildConflict.reason == "ChildConflict"
    assert str(err) == (
        "ServiceAccount etl-trainer exists and is not owned by this GRPOJob (owner: none); "
        "rename the job or delete that object"
    )
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "etl", "uid": "d-1", "controller": True}
    assert "(owner: Deployment etl uid d-1)" in str(conflict(CHILD, live(deploy), "etl"))


def test_non_controller_references_are_shown_but_are_not_ownership():
    ref = {**names.owner_reference("etl", "u-1"), "controller": False}
    assert owner_of(live(ref)) == "none (only non-controller references: GRPOJob etl uid u-1)"


def test_a_namesakes_leftover_waits_for_garbage_collection():
    err = conflict(CHILD, live(names.owner_reference("etl", "u-0")), "etl")
    assert err.reason == "ChildConflict"
    assert "earlier GRPOJob named etl" in str(err) and "garbage collection" in str(err)

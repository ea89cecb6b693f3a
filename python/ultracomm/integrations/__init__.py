"""Adapters that speak the interfaces of the MoE stacks ultracomm plugs into:

* :mod:`ultracomm.integrations.megatron_echo`: Megatron MoE ECHO's ``gen_offloading_plan``
  (:mod:`~ultracomm.integrations.echo_planner`) and expert-weight dispatcher (``preprocess`` /
  ``dispatch`` / ``fold_spare_gradients``); :mod:`~ultracomm.integrations.megatron_echo_elastic`:
  the PR #2368 form (``MoEElasticExpertDispatcher`` / ``MoESyncFreeElasticExpertDispatcher``).
* :mod:`ultracomm.integrations.ultraep`: UltraEP's ``Manager`` (switch by changing the import).
* :mod:`ultracomm.integrations.vllm_eplb`: vLLM's EPLB communicator and its factory
  ``create_eplb_communicator`` (vLLM 0.21 - 0.34, each release's calls in
  :mod:`~ultracomm.integrations.vllm_protocol`), one multicast per moved expert.
* :mod:`ultracomm.integrations.deepep_lb`: DeepEP's ``EPBuffer.lb_prefetch_weights`` / ``lb_reduce_grads``.

Each module imports only torch and ultracomm; the frameworks themselves are not needed.
"""

"""Weight transport, used by the learner and the rollout servers: tensors on the wire
(codec), the weight socket and its frames, assembling and checking an update in
recycled memory, and the relay chain between rollout servers. Below the roles, above
services.common; torch only where tensors are built (torch_codec, assembly)."""

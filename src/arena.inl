// arena: implementation.

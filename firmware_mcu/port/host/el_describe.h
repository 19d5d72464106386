/* One canonical line per message, written the same way by edgerun/mcu/protocol.py: the shared test vectors compare these. */
#ifndef EL_DESCRIBE_H
#define EL_DESCRIBE_H

#include <stddef.h>

#include "edgelink.h"

/* Returns 0 when the description fits in `cap`. */
int el_describe(const el_message *m, char *out, size_t cap);
void el_hex(const uint8_t *data, size_t len, char *out);

#endif

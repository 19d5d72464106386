/* Just the prototypes edgelink and modelslot use, for the bare-metal size estimate (make size-arm). */
#include <stddef.h>
void *memcpy(void *, const void *, size_t);
void *memset(void *, int, size_t);
int memcmp(const void *, const void *, size_t);

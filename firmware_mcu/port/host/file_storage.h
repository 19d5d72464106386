/* Flash in a file for the host port, with NOR semantics and an injectable power cut. */
#ifndef FILE_STORAGE_H
#define FILE_STORAGE_H

#include <stdint.h>

#include "modelslot.h"

typedef struct {
    int fd;
    uint32_t size;
    long ops_left; /* writes and erases before a power cut; negative: never */
    int cut;       /* the power cut happened: the last write was torn */
} file_storage;

/* Open or create `path` of `size` bytes (a new file reads as erased flash). Returns 0 on success. */
int file_storage_open(file_storage *fs, const char *path, uint32_t size, long ops_before_cut);
void file_storage_close(file_storage *fs);
void file_storage_bind(file_storage *fs, ms_storage *out);

#endif

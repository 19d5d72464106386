#include "file_storage.h"

#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int fs_read(void *ctx, uint32_t addr, uint8_t *buf, uint32_t len)
{
    file_storage *fs = ctx;
    if (addr > fs->size || len > fs->size - addr) {
        return -1;
    }
    return pread(fs->fd, buf, len, (off_t)addr) == (ssize_t)len ? 0 : -1;
}

/* One more mutating operation; when the budget runs out the power is cut. */
static int spend(file_storage *fs)
{
    if (fs->cut) {
        return -1;
    }
    if (fs->ops_left == 0) {
        fs->cut = 1;
        return -1;
    }
    if (fs->ops_left > 0) {
        fs->ops_left--;
    }
    return 0;
}

static int fs_write(void *ctx, uint32_t addr, const uint8_t *buf, uint32_t len)
{
    file_storage *fs = ctx;
    uint8_t cur[256];
    uint32_t done = 0, n, i, limit = len;
    if (addr > fs->size || len > fs->size - addr) {
        return -1;
    }
    if (spend(fs) != 0) {
        if (!fs->cut) {
            return -1;
        }
        limit = len / 2; /* the cut tears this write in half */
    }
    while (done < limit) {
        n = limit - done < sizeof cur ? limit - done : (uint32_t)sizeof cur;
        if (pread(fs->fd, cur, n, (off_t)(addr + done)) != (ssize_t)n) {
            return -1;
        }
        for (i = 0; i < n; i++) {
            cur[i] &= buf[done + i]; /* NOR flash only clears bits */
        }
        if (pwrite(fs->fd, cur, n, (off_t)(addr + done)) != (ssize_t)n) {
            return -1;
        }
        done += n;
    }
    return limit == len ? 0 : -1;
}

static int fs_erase(void *ctx, uint32_t addr, uint32_t len)
{
    file_storage *fs = ctx;
    uint8_t ones[256];
    uint32_t done = 0, n;
    if (addr > fs->size || len > fs->size - addr || spend(fs) != 0) {
        return -1;
    }
    memset(ones, 0xFF, sizeof ones);
    while (done < len) {
        n = len - done < sizeof ones ? len - done : (uint32_t)sizeof ones;
        if (pwrite(fs->fd, ones, n, (off_t)(addr + done)) != (ssize_t)n) {
            return -1;
        }
        done += n;
    }
    return 0;
}

int file_storage_open(file_storage *fs, const char *path, uint32_t size, long ops_before_cut)
{
    struct stat st;
    uint8_t ones[256];
    off_t at;
    memset(fs, 0, sizeof *fs);
    fs->fd = open(path, O_RDWR | O_CREAT, 0644);
    if (fs->fd < 0 || fstat(fs->fd, &st) != 0) {
        return -1;
    }
    memset(ones, 0xFF, sizeof ones);
    for (at = st.st_size; at < (off_t)size; at += (off_t)sizeof ones) {
        size_t n = (size_t)((off_t)size - at) < sizeof ones ? (size_t)((off_t)size - at) : sizeof ones;
        if (pwrite(fs->fd, ones, n, at) != (ssize_t)n) {
            return -1;
        }
    }
    fs->size = size;
    fs->ops_left = ops_before_cut;
    return 0;
}

void file_storage_close(file_storage *fs)
{
    if (fs->fd >= 0) {
        close(fs->fd);
        fs->fd = -1;
    }
}

void file_storage_bind(file_storage *fs, ms_storage *out)
{
    out->ctx = fs;
    out->read = fs_read;
    out->write = fs_write;
    out->erase = fs_erase;
}

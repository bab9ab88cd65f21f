// The A/B harness of this report: paged_decode_f32 (kernels/cpu/paged_decode.c) over `layers`
// caches of SmolLM2's shape (9 / 3 heads, head_dim 64), scrambled blocks; prints the best of
// `reps` calls of all layers. Usage: drv SEQS CONTEXT LAYERS REPS THREADS [BLOCK_SIZE]
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <omp.h>
int paged_decode_f32(const float *query, int64_t query_stride, const float *key_cache,
         const float *value_cache, const int32_t *block_tables, int64_t table_stride,
         const int32_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_threads,
         float scale, int64_t window, float softcap, const float *sinks);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int seqs=atoi(argv[1]),ctx=atoi(argv[2]),layers=atoi(argv[3]),reps=atoi(argv[4]),thr=atoi(argv[5]);
  int B=argc>6?atoi(argv[6]):16,bps=(ctx+B-1)/B,nb=seqs*bps; size_t per=(size_t)nb*B*3*64;
  float **K=malloc(layers*sizeof(float*)),**V=malloc(layers*sizeof(float*));
  srand(1);
  for(int l=0;l<layers;l++){K[l]=aligned_alloc(64,per*4);V[l]=aligned_alloc(64,per*4);
    for(size_t i=0;i<per;i++){K[l][i]=(rand()/(float)RAND_MAX-0.5f)*2;V[l][i]=(rand()/(float)RAND_MAX-0.5f);}}
  int32_t*tab=malloc(nb*4); for(int i=0;i<nb;i++)tab[i]=i;
  for(int i=nb-1;i>0;i--){int j=rand()%(i+1);int t=tab[i];tab[i]=tab[j];tab[j]=t;}
  int32_t*lens=malloc(seqs*4); for(int i=0;i<seqs;i++)lens[i]=ctx-(i*37)%100;
  float*q=malloc((size_t)seqs*9*64*4),*out=malloc((size_t)seqs*9*64*4); for(int i=0;i<seqs*9*64;i++)q[i]=rand()/(float)RAND_MAX-0.5f;
  double bytes=0; for(int i=0;i<seqs;i++)bytes+=lens[i]*3*64*2*4.0; bytes*=layers;
  double best=1e9, chk=0;
  for(int r=0;r<reps;r++){double t=now();
    for(int l=0;l<layers;l++) paged_decode_f32(q,9*64,K[l],V[l],tab,bps,lens,out,seqs,9,3,64,B,thr,0.125f,0,0,0);
    t=now()-t; if(t<best)best=t;}
  for(int i=0;i<seqs*9*64;i++)chk+=out[i]*(i%7+1);
  printf("%dx%d L%d thr%d: %.2f ms %.1f GB/s chk %.6f\n",seqs,ctx,layers,thr,best*1e3,bytes/best/1e9,chk);
}
